"""Step overhead of the RL loop on the tiny run: the share of a step's wall time spent neither
in engine generation (the embedded engine's prefill/decode steps) nor in Megatron's
forward/backward schedules (log-prob passes and the training pass). Goal: <= 0.05.

What the rest is: tool calls (local search), judging, agent parsing and HTTP, building the
batch, shipping it to the trainer ranks, the optimizer step, weight sync and the trajectory
dump (`time/step` is taken after it; only the metrics line, ~0.1 ms, is written after).
Periodic work is off (held-out eval, checkpoints): it is not part of a step.

    .venv/bin/python benchmarks/step_overhead.py [--steps 6] [--nproc 2]
    .venv/bin/python benchmarks/step_overhead.py --from-metrics runs/quickstart/rl/metrics.jsonl

The tiny run's steps last 0.3-0.6 s (by host), so its fixed costs (HTTP, tools, the
optimizer step, the sync) weigh more than in a run at working size; `--from-metrics` reads
the same times from a finished run's metrics.jsonl (the quickstart's RL stage: 5-30 s steps)
and reports that too.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from results import emit

from megatron_rl.config.loader import load_config
from megatron_rl.distributed.worker_pool import WorkerPool
from megatron_rl.train import train
from megatron_rl.utils.host_memory import tune_host_memory
from megatron_rl.utils.logs import quiet_libraries
from megatron_rl.utils.metrics import read_metrics


def overhead_seconds(r: dict) -> float:
    """A step's wall time neither generating nor in forward/backward."""
    return r["time/step"] - r["time/generate"] - r.get("time/forward_backward", 0.0)


def overhead_share(rows: list[dict]) -> list[float]:
    """Per step: the share of its wall time neither generating nor in forward/backward."""
    return [overhead_seconds(r) / r["time/step"] for r in rows]


def run_share(rows: list[dict]) -> float:
    """The steps' overhead seconds over their wall seconds: the share of the run's time (a
    mean of per-step shares would weigh a short step, one whose groups a partial rollout
    had nearly finished before, as much as a full one)."""
    return sum(map(overhead_seconds, rows)) / sum(r["time/step"] for r in rows)


def from_metrics(path: Path) -> None:
    rows = [r for r in read_metrics(path) if "time/step" in r and "time/generate" in r][1:]
    if not rows:
        raise SystemExit(f"{path}: no RL step with time/step and time/generate after the first")
    shares, ratio = overhead_share(rows), run_share(rows)
    step_s = statistics.mean(r["time/step"] for r in rows)
    print(f"{path}: {len(rows)} steps after the first, mean step {step_s:.1f} s; overhead "
          f"share of their time {ratio:.3f}, per step max {max(shares):.3f}")
    emit("framework overhead / RL step time (the quickstart's RL run)", ratio, 0.05,
         better="lower", note=f"{len(rows)} steps of {path}, mean {step_s:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--from-metrics", type=Path, default=None,
                    help="also report a finished run's share from its metrics.jsonl")
    ap.add_argument("overrides", nargs="*", help="extra config overrides")
    args = ap.parse_args()
    quiet_libraries()
    tune_host_memory()  # as the `megatron-rl` CLI does in every process
    if args.from_metrics is not None:
        from_metrics(args.from_metrics)
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("tiny-moe-rl-cpu", [
            f"train.steps={args.steps}", f"train.output_dir={out}", "checkpoint.dir=null",
            "rl.eval_every=0",
            *([] if args.nproc == 2 else ["parallel.ep=1"]), *args.overrides])
        with WorkerPool(args.nproc) as pool:
            rows = train(cfg, pool)
    rows = rows[1:]  # the first step pays one-off costs (imports, first allocations)
    print(f"\n{len(rows)} steps after warm-up, tiny-moe on {args.nproc} trainer rank(s), "
          f"{cfg.rl.sampling.groups_per_step} groups x "
          f"{cfg.rl.sampling.samples_per_prompt} samples, "
          f"{cfg.rl.agent} agent, max_turns {cfg.rl.max_turns}")
    print(f"{'step s':>8} {'generate':>9} {'fwd/bwd':>8} {'other':>8} {'overhead':>9}")
    shares = overhead_share(rows)
    for r, share in zip(rows, shares, strict=True):
        step, gen, fb = r["time/step"], r["time/generate"], r.get("time/forward_backward", 0.0)
        print(f"{step:8.2f} {gen:9.2f} {fb:8.2f} {step - gen - fb:8.2f} {share:9.3f}")
    parts = ("time/judge", "time/sync", "time/train", "time/rollout")
    print("mean seconds: " + ", ".join(f"{k}={statistics.mean(r[k] for r in rows):.3f}"
                                       for k in parts))
    ratio = run_share(rows)
    print(f"\nstep overhead (not generation, not forward/backward) / step time: {ratio:.3f} "
          f"(goal <= 0.05: {'PASS' if ratio <= 0.05 else 'MISS'})")
    emit("framework overhead / RL step time (tiny run)", ratio, 0.05, better="lower",
         note=f"{cfg.rl.sampling.groups_per_step} groups x {cfg.rl.sampling.samples_per_prompt}"
              f" samples, mean step {statistics.mean(r['time/step'] for r in rows):.2f} s")


if __name__ == "__main__":
    main()
