"""Trajectory filters (`megatron-rl data filter`): dumped rollouts in, the ones worth training
or distilling on out. Each filter returns why it drops a trajectory (or None to keep it); the
pipeline runs them in order and counts, per filter, what it saw, dropped and why.

- correctness: terminated successfully (no environment or model failure label, an answer, the
  last turn not cut by the length limit) AND judged correct: `metadata["judge"]["correct"]
  is True` where the judge recorded a verdict (it is what the outcome reward came from), else
  `rewards["outcome"] >= min_outcome` (dumps without a judge record).
- degeneracy: the trajectory's `degenerate` label, any turn's text failing the detector of
  `utils.degeneracy` (the one the agents label online with), or consecutive tool calls with
  the same name and byte-identical arguments (canonical JSON). A repeat after a call that
  failed is a retry, not a loop.
- depth: at least K tool-call turns (a turn counts when one of its calls ran: not a parse
  error, not an excess call).
- dedup: exact duplicates of the full message sequence (question, then every turn's role,
  text and tool calls with observations); distinct rollouts of one question differ there and
  stay. Keeps the first copy.

Input is the RL loop's `trajectories.jsonl` (`Trajectory.to_dict()` plus "step"); kept lines
are written out unchanged. A line that is not a trajectory is dropped as `unreadable`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.records.trajectory import ENV_FAILURES, MODEL_FAILURES, Trajectory
from megatron_rl.utils.degeneracy import DEFAULT, DegeneracyConfig, find_degeneracy

log = logging.getLogger("megatron_rl.data")

NOT_RUN = ("tool_parse_error", "excess_tool_calls")  # call errors: the call never ran


def canonical(arguments: Any) -> str:
    """Tool arguments as bytes-comparable JSON (keys sorted, no spacing choices left)."""
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


# -- the filters -----------------------------------------------------------------------------

@dataclass
class Correctness:
    min_outcome: float = 1.0
    name: str = "correctness"

    def __call__(self, traj: Trajectory) -> str | None:
        for group, kind in ((ENV_FAILURES, "env_failure"), (MODEL_FAILURES, "model_failure")):
            bad = [label for label in traj.labels if label in group]
            if bad:
                return f"{kind}:{bad[0]}"
        if traj.answer is None or not traj.answer.strip():
            return "no_answer"
        if traj.turns and traj.turns[-1].finish_reason != "stop":
            return f"cut:{traj.turns[-1].finish_reason}"
        judge = traj.metadata.get("judge")
        if isinstance(judge, dict) and "correct" in judge:
            return None if judge["correct"] is True else "incorrect"
        outcome = traj.rewards.get("outcome")
        if outcome is None:
            return "unjudged"
        return None if outcome >= self.min_outcome else "incorrect"


@dataclass
class Degeneracy:
    config: DegeneracyConfig = DEFAULT
    name: str = "degeneracy"

    def __call__(self, traj: Trajectory) -> str | None:
        if "degenerate" in traj.labels:
            return "label"
        for turn in traj.turns:
            found = find_degeneracy(turn.text, self.config)
            if found is not None:
                return found.kind
        previous = None
        for turn in traj.turns:
            for call in turn.tool_calls:
                key = (call.name, canonical(call.arguments))
                if previous is not None and key == previous[0] and previous[1] is None:
                    return "identical_calls"
                previous = (key, call.error)
        return None


def tool_call_turns(traj: Trajectory) -> int:
    return sum(any(c.error not in NOT_RUN for c in t.tool_calls) for t in traj.turns)


@dataclass
class Depth:
    min_turns: int = 2
    name: str = "depth"

    def __call__(self, traj: Trajectory) -> str | None:
        n = tool_call_turns(traj)
        return None if n >= self.min_turns else f"below_{self.min_turns}"


def message_key(traj: Trajectory) -> bytes:
    """A digest of the full message sequence; uids, rewards and token ids play no part."""
    messages = [traj.question] + [
        [t.role, t.text, [[c.name, canonical(c.arguments), c.error, c.observation]
                          for c in t.tool_calls]] for t in traj.turns]
    return hashlib.sha256(json.dumps(messages, ensure_ascii=False).encode("utf-8",
                                                                      "replace")).digest()


@dataclass
class Dedup:
    name: str = "dedup"
    seen: set[bytes] = field(default_factory=set)

    def __call__(self, traj: Trajectory) -> str | None:
        key = message_key(traj)
        if key in self.seen:
            return "duplicate"
        self.seen.add(key)
        return None


Filter = Callable[[Trajectory], str | None]


# -- the pipeline ----------------------------------------------------------------------------

@dataclass
class FilterStats:
    seen: int = 0
    dropped: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "dropped": self.dropped,
                "reasons": dict(self.reasons.most_common())}


class FilterPipeline:
    """Filters in order; a trajectory stops at the first that drops it."""

    def __init__(self, filters: Iterable[Filter]):
        self.filters = list(filters)
        self.names = [getattr(f, "name", type(f).__name__) for f in self.filters]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"filter names must be unique: {self.names}")
        self.stats = {n: FilterStats() for n in ["read", *self.names]}
        self.kept = 0

    def drop_reason(self, traj: Trajectory) -> str | None:
        """`filter:reason` of the first filter that drops it, None when all keep it."""
        for name, f in zip(self.names, self.filters, strict=True):
            st = self.stats[name]
            st.seen += 1
            why = f(traj)
            if why is not None:
                st.dropped += 1
                st.reasons[why] += 1
                return f"{name}:{why}"
        self.kept += 1
        return None

    def keep(self, traj: Trajectory) -> bool:
        return self.drop_reason(traj) is None

    def unreadable(self, why: str) -> None:
        st = self.stats["read"]
        st.seen += 1
        st.dropped += 1
        st.reasons[why] += 1

    def report(self) -> dict[str, Any]:
        return {"kept": self.kept, "filters": {n: s.to_dict() for n, s in self.stats.items()}}

    def summary(self) -> str:
        lines = [f"kept {self.kept}"]
        for name, st in self.stats.items():
            why = ", ".join(f"{r} {c}" for r, c in st.reasons.most_common())
            lines.append(f"  {name:<12} saw {st.seen:>8}  dropped {st.dropped:>8}"
                         + (f"  ({why})" if why else ""))
        return "\n".join(lines)


def read_trajectory(line: str) -> tuple[Trajectory, dict[str, Any]]:
    """A dumped line as a Trajectory and the extra keys the dump added (e.g. "step")."""
    row = json.loads(line)
    if not isinstance(row, dict):
        raise ValueError(f"a JSON {type(row).__name__}, not an object")
    known = set(Trajectory.__dataclass_fields__)
    extra = {k: row.pop(k) for k in list(row) if k not in known}
    return Trajectory.from_dict(row), extra


def filter_file(src: Path, dst: Path, pipeline: FilterPipeline,
                progress_every: int = 10_000) -> dict[str, Any]:
    """JSONL in, kept lines out (unchanged); returns the pipeline's report."""
    t0 = time.monotonic()
    with src.open(encoding="utf-8") as fin, dst.open("w", encoding="utf-8") as fout:
        for n, line in enumerate(fin, 1):
            if line.strip():
                try:
                    traj, _ = read_trajectory(line)
                except (ValueError, TypeError, KeyError) as e:
                    pipeline.unreadable(type(e).__name__)
                    log.warning("%s:%d: not a trajectory: %s", src, n, str(e)[:200])
                else:
                    pipeline.stats["read"].seen += 1
                    if pipeline.keep(traj):
                        fout.write(line if line.endswith("\n") else line + "\n")
            if progress_every and n % progress_every == 0:
                print(f"{n} lines, kept {pipeline.kept} "
                      f"({n / (time.monotonic() - t0):.0f} lines/s)", file=sys.stderr)
    return pipeline.report()


def default_pipeline(min_depth: int = 2, min_outcome: float = 1.0,
                     degeneracy: DegeneracyConfig = DEFAULT, correctness: bool = True,
                     dedup: bool = True) -> FilterPipeline:
    filters: list[Filter] = [Correctness(min_outcome)] if correctness else []
    filters += [Degeneracy(degeneracy), Depth(min_depth)]
    return FilterPipeline(filters + ([Dedup()] if dedup else []))


# -- CLI -------------------------------------------------------------------------------------

def _run(args: argparse.Namespace) -> int:
    cfg = DegeneracyConfig(window=args.window, max_ratio=args.max_ratio,
                           max_char_run=args.max_char_run, line_repeats=args.line_repeats)
    pipeline = default_pipeline(args.min_depth, args.min_outcome, cfg,
                                correctness=not args.no_correctness, dedup=not args.no_dedup)
    report = filter_file(Path(args.input), Path(args.output), pipeline, args.progress_every)
    print(pipeline.summary())
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def add_filter_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`filter`: add it under `megatron-rl data`."""
    p = subparsers.add_parser("filter", help="keep correct, sound, deep, unique trajectories")
    p.add_argument("input", help="trajectories.jsonl (as the RL loop dumps it)")
    p.add_argument("output", help="the kept lines, unchanged")
    p.add_argument("--min-depth", type=int, default=2, help="tool-call turns at least")
    p.add_argument("--min-outcome", type=float, default=1.0,
                   help="correct when no judge verdict is recorded: outcome reward at least")
    p.add_argument("--window", type=int, default=DEFAULT.window, help="detector window, bytes")
    p.add_argument("--max-ratio", type=float, default=DEFAULT.max_ratio,
                   help="a window compressing below this ratio is a loop")
    p.add_argument("--max-char-run", type=int, default=DEFAULT.max_char_run)
    p.add_argument("--line-repeats", type=int, default=DEFAULT.line_repeats)
    p.add_argument("--no-correctness", action="store_true")
    p.add_argument("--no-dedup", action="store_true")
    p.add_argument("--report", help="write the per-filter counts here (JSON)")
    p.add_argument("--progress-every", type=int, default=10_000)
    p.set_defaults(func=_run)
    return p
