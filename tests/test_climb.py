"""`megatron-rl climb`: RL -> select -> SFT -> RL rounds, recorded, resumable, stopping on an
empty candidate pool (the real CLI: real ranks, real RL and SFT runs)."""

from __future__ import annotations

import json
import subprocess
import sys

BASE = ["tiny-moe-rl-sanity-cpu", "train.steps=2", "rl.eval_every=0", "climb.min_tool_calls=0",
        "climb.sft_overrides=[train.steps=2,train.global_batch_size=4,sft.eval_every=0,"
        "checkpoint.export_hf=false]"]


def _climb(out, rounds: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "climb", *BASE,
           f"train.output_dir={out}", "--rounds", str(rounds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _records(out) -> list[dict]:
    return [json.loads(x) for x in (out / "climb.jsonl").read_text().splitlines()]


def test_climb_rounds_select_sft_rl_and_stop(tmp_path):
    out = tmp_path / "climb"
    # round 0 only: one RL run, recorded
    _climb(out, 0)
    [r0] = _records(out)
    assert r0["round"] == 0 and r0["rl/steps"] == 2
    assert (out / "round_0/rl/checkpoints/latest").read_text() == "step_000002"
    # the random policy never scores 1.0 on all 16 tokens: let the judge have passed every
    # other rollout of each query, so every query sits at pass rate 1/2 (the band's top)
    dump = out / "round_0/rl/trajectories.jsonl"
    rows = [json.loads(x) for x in dump.read_text().splitlines()]
    for i, row in enumerate(rows):
        row["rewards"]["outcome"] = float(i % 2)
    dump.write_text("".join(json.dumps(r) + "\n" for r in rows))
    queries = {r["group_id"] for r in rows}

    # the re-run resumes at round 1: select -> SFT from round 0's RL weights -> RL from SFT's
    proc = _climb(out, 2)
    r0_again, r1, r2 = _records(out)
    assert r0_again == r0  # not re-run
    assert r1["select/queries"] == len(queries) and r1["select/candidates"] == len(queries)
    assert r1["select/selected"] == len(queries) and r1["select/unsolved"] == 0
    picked = [json.loads(x) for x in (out / "round_1/select/sft.jsonl").read_text().splitlines()]
    assert len(picked) == len(queries) and all(p["rewards"]["outcome"] == 1.0 for p in picked)
    assert r1["sft/steps"] == 2 and r1["sft/loss_first"] > 0
    assert (out / "round_1/sft/checkpoints/latest").read_text() == "step_000002"
    assert r1["rl/steps"] == 2 and (out / "round_1/rl/checkpoints/latest").is_file()
    # round 1's real rollouts again never pass: round 2 stops on the empty pool
    assert r2["round"] == 2 and r2["stopped"] == "empty candidate pool"
    assert r2["select/candidates"] == 0 and not (out / "round_2/rl").exists()
    assert "round 2: empty candidate pool" in proc.stdout
    png = (out / "climb_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
