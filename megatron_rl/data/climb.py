"""SFT–RL climbing (Iris), the selection step: `megatron-rl data climb --rollouts RUN_DIR`.

From an RL run's trajectory dumps, keep the queries the policy solves sometimes but not
reliably (0 < pass rate <= 1/2, over every rollout of the query in the dump); among their
correct rollouts with at least `min_tool_calls` tool calls take the shortest (fewest
generated tokens), one per query; exact duplicates (same message sequence) go. The result is
the next round's SFT set, as trajectory JSONL. The candidate pool (queries in the pass-rate
band) is the stopping signal: when it runs dry the policy has nothing left to climb.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.records.prompt import question_key
from megatron_rl.records.trajectory import Trajectory


@dataclass
class ClimbCounts:
    rollouts: int = 0
    queries: int = 0
    candidates: int = 0         # queries with 0 < pass rate <= max_pass_rate
    too_easy: int = 0           # pass rate above the band
    unsolved: int = 0           # never correct
    no_deep_correct: int = 0    # candidates without a correct rollout of enough tool calls
    duplicates: int = 0
    selected: int = 0


def query_of(row: dict[str, Any]) -> str:
    """The query a rollout answers: its group id without the epoch suffix (`q3.e1` → `q3`),
    so rollouts of one question across steps and epochs pool together."""
    return question_key(str(row.get("group_id", "")))


def correct(row: dict[str, Any]) -> bool:
    return float(row.get("rewards", {}).get("outcome", 0.0)) >= 1.0


def tool_calls(row: dict[str, Any]) -> int:
    return sum(len(t.get("tool_calls") or []) for t in row.get("turns", []))


def generated_tokens(row: dict[str, Any]) -> int:
    return sum(len(t.get("output_ids") or []) for t in row.get("turns", []))


def fingerprint(row: dict[str, Any]) -> str:
    """The full message sequence (what SFT would train on) as a digest."""
    turns = row.get("turns", [])
    msgs = [turns[0].get("context_ids") if turns else None,
            *[(t.get("role"), t.get("output_ids"), t.get("observation_ids")) for t in turns]]
    return hashlib.sha256(json.dumps(msgs).encode()).hexdigest()


def select(rows: list[dict[str, Any]], *, max_pass_rate: float = 0.5,
           min_tool_calls: int = 1) -> tuple[list[dict[str, Any]], ClimbCounts]:
    by_query: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_query[query_of(row)].append(row)
    counts = ClimbCounts(rollouts=len(rows), queries=len(by_query))
    chosen, seen = [], set()
    for query in sorted(by_query):
        group = by_query[query]
        rate = sum(map(correct, group)) / len(group)
        if rate == 0:
            counts.unsolved += 1
            continue
        if rate > max_pass_rate:
            counts.too_easy += 1
            continue
        counts.candidates += 1
        deep = [r for r in group if correct(r) and tool_calls(r) >= min_tool_calls]
        if not deep:
            counts.no_deep_correct += 1
            continue
        best = min(deep, key=lambda r: (generated_tokens(r), r.get("uid", "")))
        key = fingerprint(best)
        if key in seen:
            counts.duplicates += 1
            continue
        seen.add(key)
        chosen.append(best)
    counts.selected = len(chosen)
    return chosen, counts


def read_dumps(run_dir: Path) -> list[dict[str, Any]]:
    """Every trajectory of a run folder's `trajectories.jsonl` (or of a JSONL path), checked
    to be a trajectory (`Trajectory.from_dict`); a bad line names the file and line."""
    path = run_dir / "trajectories.jsonl" if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise ValueError(f"{path}: no trajectory dump there")
    rows = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                Trajectory.from_dict({k: v for k, v in row.items() if k != "step"})
            except (json.JSONDecodeError, RecursionError, TypeError, KeyError, ValueError) as e:
                raise ValueError(f"{path}: line {i}: not a trajectory ({type(e).__name__}: "
                                 f"{str(e)[:120]})") from None
            rows.append(row)
    return rows


def write_selection(chosen: list[dict[str, Any]], out: Path) -> Path:
    """The next SFT set as trajectory JSONL, written atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}")
    with tmp.open("w") as f:
        for row in chosen:
            f.write(json.dumps(row) + "\n")
    tmp.replace(out)
    return out


def main(args: argparse.Namespace) -> int:
    rows = read_dumps(Path(args.rollouts))
    chosen, c = select(rows, max_pass_rate=args.max_pass_rate,
                       min_tool_calls=args.min_tool_calls)
    out = write_selection(chosen, Path(args.out))
    print(f"[climb] {c.rollouts} rollouts of {c.queries} queries: candidate pool {c.candidates} "
          f"(0 < pass rate <= {args.max_pass_rate}; {c.too_easy} too easy, {c.unsolved} "
          f"unsolved); {c.no_deep_correct} without a correct rollout of >= "
          f"{args.min_tool_calls} tool calls, {c.duplicates} duplicates; {c.selected} selected "
          f"-> {out}")
    return 0


def add_climb_parser(sub: Any) -> None:
    p = sub.add_parser("climb", help="SFT-RL climbing: the next SFT set from an RL run's dumps")
    p.add_argument("--rollouts", required=True, help="an RL run folder (its trajectories.jsonl)")
    p.add_argument("--out", required=True, help="trajectory JSONL for the next SFT round")
    p.add_argument("--max-pass-rate", dest="max_pass_rate", type=float, default=0.5)
    p.add_argument("--min-tool-calls", dest="min_tool_calls", type=int, default=1,
                   help="K_rft: the fewest tool calls a kept rollout makes")
    p.set_defaults(func=main)
