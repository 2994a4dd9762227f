"""SFT-RL climbing's selection on a crafted RL dump: the pass-rate band, the shortest correct
rollout with enough tool calls, one per query, exact duplicates dropped, the pool size."""

from __future__ import annotations

import json
import subprocess
import sys

from megatron_rl.data.climb import select
from megatron_rl.records.trajectory import ToolCall, Trajectory, Turn


def _row(uid: str, group: str, outcome: float, calls: int, tokens: int, step: int = 1,
         salt: int = 0) -> dict:
    turns = [Turn("agent", [1, 2], [3 + salt] * tokens, [0.0] * tokens, [0] * tokens,
                  tool_calls=[ToolCall("search", {"query": f"q{k}"}, observation="obs")
                              for k in range(calls)])]
    t = Trajectory(uid, group, "question?", "ans", turns, rewards={"outcome": outcome})
    return {"step": step, **t.to_dict()}


def _dump() -> list[dict]:
    return [
        # q1: 1 of 4 correct (0.25): the correct one has 2 calls -> selected
        _row("a", "q1.e0", 1.0, 2, 9), _row("b", "q1.e0", 0.0, 1, 3),
        _row("c", "q1.e1", 0.0, 1, 3, step=2), _row("d", "q1.e1", 0.0, 0, 3, step=2),
        # q2: 2 of 4 (0.5, inside the band): the shortest correct with >= 1 call is f (5)
        _row("e", "q2.e0", 1.0, 1, 12), _row("f", "q2.e0", 1.0, 3, 5),
        _row("g", "q2.e0", 0.0, 1, 4), _row("h", "q2.e0", 0.0, 1, 4),
        # q3: 3 of 4 correct: too easy
        *[_row(f"i{k}", "q3.e0", 1.0 if k < 3 else 0.0, 1, 4) for k in range(4)],
        # q4: never correct: unsolved
        _row("j", "q4.e0", 0.0, 1, 4), _row("k", "q4.e0", 0.0, 1, 4),
        # q5: correct only without tool calls: no deep correct rollout
        _row("l", "q5.e0", 1.0, 0, 2), _row("m", "q5.e0", 0.0, 1, 2),
        # q6: the same messages as q1's pick: a duplicate
        _row("n", "q6.e0", 1.0, 2, 9), _row("o", "q6.e0", 0.0, 1, 3, salt=1),
    ]


def test_selection_band_shortest_deep_correct_and_dedup():
    chosen, c = select(_dump(), max_pass_rate=0.5, min_tool_calls=1)
    assert [r["uid"] for r in chosen] == ["a", "f"]
    assert (c.rollouts, c.queries, c.candidates, c.too_easy, c.unsolved) == (18, 6, 4, 1, 1)
    assert (c.no_deep_correct, c.duplicates, c.selected) == (1, 1, 2)
    # K_rft = 3 leaves q1 (2 calls) without a deep correct rollout
    chosen, c = select(_dump(), min_tool_calls=3)
    assert [r["uid"] for r in chosen] == ["f"] and c.no_deep_correct == 3


def test_cli_writes_the_next_sft_set(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _dump()))
    out = tmp_path / "sft.jsonl"
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "data", "climb",
                           "--rollouts", str(run), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "candidate pool 4" in proc.stdout and "2 selected" in proc.stdout
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["uid"] for r in rows] == ["a", "f"]
    assert Trajectory.from_dict({k: v for k, v in rows[0].items() if k != "step"}).turns
    (run / "trajectories.jsonl").write_text("{not json\n")
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "data", "climb",
                           "--rollouts", str(run), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "trajectories.jsonl: line 1: not a trajectory" in proc.stderr
