"""Process rewards read off a trajectory's own record (no judge call), for the reward managers
that credit more than the outcome (`algorithms/reward_managers.py`). Each writer stores its
signals on the trajectory (`rewards[...]`) and its turns (`turn.rewards[...]`); the driver runs
the writers a manager names in its `needs`.

C-GRPO (single-agent, three-step process evaluation): `rewards["process"]` is the mean of
three 0/1 checks, so it lies in {0, 1/3, 2/3, 1}, with the checks as `rewards["retrieval"]`,
`["evidence"]`, `["grounding"]`:
  1. retrieval: it made at least one tool call, and every call succeeded (no error) with a
     non-empty observation. Calls on a turn labelled `max_turns` were never run (the step
     limit) and are not judged.
  2. evidence: some successful call's observation contains a reference answer.
  3. grounding: the final answer (None when truncated, as for the judge) is contained in
     some successful call's observation, i.e. the answer is supported by what it saw.
"Contains" is a match at word boundaries after SQuAD normalisation (`rule.normalize_answer`:
lowercase, no punctuation, no articles); a reference may be a JSON list of answers.

Intermediate facts (v1): a multi-hop question carries its bridge entities in
`Trajectory.metadata["facts"]` (from `data.world.Question.facts`). A fact is surfaced by a turn
when it is contained (as above) in the turn's generated text or in the observation of one of
its successful tool calls. `rewards["fact_recall"]` = the fraction of the (distinct) facts
surfaced anywhere in the trajectory (absent without facts); `turn.rewards["fact"]` = the share
of the facts that turn surfaced first, so a trajectory's turns add up to its recall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_rl.records.trajectory import ToolCall, Trajectory, Turn
from megatron_rl.rewards.base import references
from megatron_rl.rewards.composite import final_answer, is_truncated
from megatron_rl.rewards.rule import normalize_answer


def contains(text: str, needle: str) -> bool:
    """`needle` occurs in `text` at word boundaries, both SQuAD-normalised; never for an empty
    needle."""
    n = normalize_answer(needle)
    return bool(n) and f" {n} " in f" {normalize_answer(text)} "


def _judged_calls(turn: Turn) -> list[ToolCall]:
    return [] if "max_turns" in turn.labels else turn.tool_calls


def _observations(turn: Turn) -> list[str]:
    return [c.observation for c in _judged_calls(turn) if c.error is None and c.observation]


# -- C-GRPO's process evaluation --------------------------------------------------------------

@dataclass
class ProcessChecks:
    retrieval: bool
    evidence: bool
    grounding: bool

    @property
    def score(self) -> float:
        return (self.retrieval + self.evidence + self.grounding) / 3


def process_checks(traj: Trajectory) -> ProcessChecks:
    calls = [c for t in traj.turns for c in _judged_calls(t)]
    observations = [o for t in traj.turns for o in _observations(t)]
    retrieval = bool(calls) and all(c.error is None and c.observation for c in calls)
    refs = references(traj.reference) if traj.reference is not None else []
    evidence = any(contains(o, r) for o in observations for r in refs)
    answer = None if is_truncated(traj) else final_answer(traj)
    grounding = answer is not None and any(contains(o, answer) for o in observations)
    return ProcessChecks(retrieval, evidence, grounding)


def _facts(traj: Trajectory) -> list[str]:
    facts = traj.metadata.get("facts") or []
    facts = [facts] if isinstance(facts, str) else facts
    return list({normalize_answer(f): f for f in facts if normalize_answer(f)}.values())


def facts_by_turn(traj: Trajectory) -> list[int]:
    """How many of the trajectory's facts each turn surfaces first."""
    left, out = _facts(traj), []
    for turn in traj.turns:
        texts = [turn.text, *_observations(turn)]
        new = [f for f in left if any(contains(x, f) for x in texts)]
        left = [f for f in left if f not in new]
        out.append(len(new))
    return out


def fact_recall(traj: Trajectory) -> float | None:
    """Fraction of the facts surfaced anywhere in the trajectory; None without facts."""
    n = len(_facts(traj))
    return sum(facts_by_turn(traj)) / n if n else None


def write_process_rewards(trajectories: Sequence[Trajectory]) -> None:
    """C-GRPO's checks and their mean, on every trajectory."""
    for traj in trajectories:
        c = process_checks(traj)
        traj.rewards.update(process=c.score, retrieval=float(c.retrieval),
                            evidence=float(c.evidence), grounding=float(c.grounding))


def write_fact_rewards(trajectories: Sequence[Trajectory]) -> None:
    """Fact recall per trajectory and the first-surfaced share per turn (when it has facts)."""
    for traj in trajectories:
        n = len(_facts(traj))
        if not n:
            traj.rewards.pop("fact_recall", None)
            continue
        first = facts_by_turn(traj)
        traj.rewards["fact_recall"] = sum(first) / n
        for turn, count in zip(traj.turns, first, strict=True):
            turn.rewards["fact"] = count / n


# the writers a reward manager can name in its `needs`
REWARD_WRITERS = {"process": write_process_rewards, "facts": write_fact_rewards}
