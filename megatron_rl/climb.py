"""`megatron-rl climb RECIPE [--rounds R] [overrides]`: Iris's SFT-RL climbing, top-down.

round 0: RL with the recipe as given → `<out>/round_0/rl/`
round r = 1..R: select from round r-1's rollouts (`data/climb.py`: queries with
0 < pass rate <= climb.max_pass_rate, their shortest correct rollout with enough tool calls)
→ SFT from round r-1's RL weights on the selection (plus the SFT recipe's own data when
climb.keep_sft_data) → RL from the SFT weights.

Every stage writes its own folder under `<out>/round_<r>/` (metrics, curves, checkpoints) and
every finished round appends one record to `<out>/climb.jsonl` (counts of the selection, pass
rates, losses, seconds), plotted as `<out>/climb_curves.png`. A re-run skips the finished
rounds. An empty candidate pool ends the climb early: the policy has nothing left to climb.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

from megatron_rl.config.loader import load_config
from megatron_rl.config.schema import Config
from megatron_rl.data.climb import read_dumps, select, write_selection
from megatron_rl.distributed.spmd import SPMDGroup
from megatron_rl.sft import sft
from megatron_rl.train import train
from megatron_rl.utils.metrics import plot_metrics

CURVES = ("rl/pass_rate_first", "rl/pass_rate_last", "select/candidates", "select/selected",
          "sft/loss_last")


def _with(cfg: Config, out: Path, init_from: str | None) -> Config:
    """`cfg` writing to `out` (metrics and checkpoints), started from `init_from`'s weights
    when given (else the recipe's own start)."""
    ck = dataclasses.replace(cfg.checkpoint, dir=str(out / "checkpoints"), load=None,
                             init_from=init_from or cfg.checkpoint.init_from)
    return dataclasses.replace(cfg, checkpoint=ck, train=dataclasses.replace(
        cfg.train, output_dir=str(out)))


def sft_config(cfg: Config) -> Config:
    """The SFT stage's recipe with the RL recipe's model and parallel layout (one model, one
    set of trainer ranks for both stages)."""
    s = load_config(cfg.climb.sft_recipe, list(cfg.climb.sft_overrides))
    return dataclasses.replace(s, model=cfg.model, parallel=cfg.parallel)


def _rl(cfg: Config, group: SPMDGroup, out: Path, init_from: str | None) -> dict[str, Any]:
    rows = train(_with(cfg, out, init_from), group)
    # over every group sampled (a step whose groups dynamic sampling all dropped has no kept
    # trajectory, so no rollout/pass_rate or reward/outcome_mean)
    rate = "rollout/sampled_outcome_mean"
    return {"rl/steps": len(rows), "rl/pass_rate_first": rows[0][rate],
            "rl/pass_rate_last": rows[-1][rate],
            "rl/reward_first": rows[0].get("reward/outcome_mean", rows[0][rate]),
            "rl/reward_last": rows[-1].get("reward/outcome_mean", rows[-1][rate])}


def _sft(cfg: Config, group: SPMDGroup, out: Path, data: Path,
         init_from: str) -> dict[str, Any]:
    s = sft_config(cfg)
    files = (str(data), *(s.sft.train_files if cfg.climb.keep_sft_data else ()))
    s = _with(dataclasses.replace(s, sft=dataclasses.replace(s.sft, train_files=files)), out,
              init_from)
    rows = [r for r in sft(s, group) if "loss" in r]
    return {"sft/steps": len(rows), "sft/loss_first": rows[0]["loss"],
            "sft/loss_last": rows[-1]["loss"]}


def climb(cfg: Config, group: SPMDGroup) -> list[dict[str, Any]]:
    """The rounds; `group` runs jobs on the trainer ranks. Returns one record per round."""
    c, out = cfg.climb, Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "climb.jsonl"
    done = [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
    # a climb that ran dry stays ended: its last round has no RL run to select from
    first = c.rounds + 1 if done and "stopped" in done[-1] else len(done)
    for r in range(first, c.rounds + 1):
        t0, here = time.perf_counter(), out / f"round_{r}"
        shutil.rmtree(here, ignore_errors=True)  # an unfinished attempt starts over
        record: dict[str, Any] = {"round": r}
        init = None
        if r:
            last_rl = out / f"round_{r - 1}" / "rl"
            chosen, counts = select(read_dumps(last_rl), max_pass_rate=c.max_pass_rate,
                                    min_tool_calls=c.min_tool_calls)
            record.update({f"select/{k}": v for k, v in dataclasses.asdict(counts).items()})
            print(f"[climb] round {r}: candidate pool {counts.candidates} of "
                  f"{counts.queries} queries, {counts.selected} selected", flush=True)
            if not chosen:
                record["stopped"] = "empty candidate pool"
                _append(log, record, t0)
                done.append(record)
                break
            selection = write_selection(chosen, here / "select" / "sft.jsonl")
            record.update(_sft(cfg, group, here / "sft", selection,
                               str(last_rl / "checkpoints")))
            init = str(here / "sft" / "checkpoints")
        record.update(_rl(cfg, group, here / "rl", init))
        print(f"[climb] round {r}: RL pass rate {record['rl/pass_rate_first']:.3f} -> "
              f"{record['rl/pass_rate_last']:.3f}", flush=True)
        _append(log, record, t0)
        done.append(record)
    plot_metrics([{"step": d["round"], **d} for d in done], CURVES, out / "climb_curves.png")
    return done


def _append(log: Path, record: dict[str, Any], t0: float) -> None:
    record["seconds"] = round(time.perf_counter() - t0, 1)
    with log.open("a") as f:
        f.write(json.dumps(record) + "\n")
