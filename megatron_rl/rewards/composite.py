"""Composite reward assembly: outcome (judge) + per-turn rubric scores, written on the
Trajectories the RL loop consumes.

- `trajectory.rewards["outcome"]`: the judge's score of the final answer. A truncated
  trajectory (its last turn hit the length limit, or it is labelled `overlong`) or one with no
  answer scores 0 without a judge call.
- `turn.rewards["rubric"]`: the rubric score of each Planner / Synthesizer turn, in [0, 1].
- A judge that fails labels the trajectory `judge_error` (an environment failure) and writes no
  reward: it is not a 0, and the loss leaves it out.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from megatron_rl.records.trajectory import Trajectory
from megatron_rl.rewards.base import (
    JUDGE_ERROR,
    Judge,
    Verdict,
    extract_answer,
    judge_failed,
    no_answer,
)
from megatron_rl.rewards.registry import JUDGES, RUBRICS
from megatron_rl.rewards.rubric import TurnScorer
from megatron_rl.utils.secrets import redact

log = logging.getLogger("megatron_rl.rewards")


def is_truncated(traj: Trajectory) -> bool:
    cut = traj.turns and traj.turns[-1].finish_reason == "length"
    return bool({"overlong", "response_too_long"} & set(traj.labels) or cut)


def final_answer(traj: Trajectory) -> str | None:
    """The answer the agent recorded, else the one extracted from the last turn's text."""
    if traj.answer is not None:
        return traj.answer.strip() or None
    return extract_answer(traj.turns[-1].text) if traj.turns else None


async def judge_trajectory(traj: Trajectory, judge: Judge) -> Verdict:
    """Judge one trajectory and record the result on it; never raises for a judge failure."""
    if traj.reference is None:
        raise ValueError(f"trajectory {traj.uid}: no reference answer to judge against")
    if is_truncated(traj):
        verdict = no_answer("truncated")
    else:
        try:
            verdict = await judge.judge(traj.question, final_answer(traj), traj.reference)
        except Exception as e:  # a judge bug must not take the whole group down
            log.warning("judge raised on trajectory %s: %s: %s", traj.uid, type(e).__name__,
                        redact(str(e)))
            verdict = judge_failed(f"judge raised {type(e).__name__}")
    traj.metadata["judge"] = {"correct": verdict.correct, "detail": verdict.detail}
    if verdict.error:
        traj.add_label(JUDGE_ERROR)
        traj.rewards.pop("outcome", None)
    else:
        traj.rewards["outcome"] = verdict.score
    return verdict


async def score_group(trajectories: list[Trajectory], judge: Judge,
                      rubric: TurnScorer | None = None) -> list[Verdict]:
    """Judge a group (and rubric-score its turns) concurrently; returns the verdicts in order.

    The judge's own limits (concurrency cap, rate) bound what is in flight."""
    missing = [t.uid for t in trajectories if t.reference is None]
    if missing:
        raise ValueError(f"no reference answer for trajectories {', '.join(missing)}")

    jobs = [judge_trajectory(t, judge) for t in trajectories]
    if rubric is not None:
        jobs += [_rubric_trajectory(t, rubric) for t in trajectories]
    results = await asyncio.gather(*jobs)
    return list(results[:len(trajectories)])


async def _rubric_trajectory(traj: Trajectory, rubric: TurnScorer) -> None:
    try:
        await rubric.score_trajectory(traj)
    except Exception as e:  # e.g. a custom context_fn that breaks on an odd trajectory
        log.warning("rubric scoring raised on %s: %s: %s", traj.uid, type(e).__name__,
                    redact(str(e)))
        traj.add_label(JUDGE_ERROR)


@dataclass
class RewardWeights:
    outcome: float = 1.0
    rubric: float = 0.0


def turn_rewards(traj: Trajectory, weights: RewardWeights | None = None) -> list[float] | None:
    """One scalar per turn: outcome * w_outcome + rubric * w_rubric (a turn without a rubric
    score gets the outcome part only). None for environment failures: they carry no reward."""
    w = weights or RewardWeights()
    if traj.env_failure or "outcome" not in traj.rewards:
        return None
    base = w.outcome * traj.rewards["outcome"]
    return [base + w.rubric * t.rewards["rubric"] if "rubric" in t.rewards else base
            for t in traj.turns]


def build_judge(spec: dict[str, Any] | None = None, where: str = "rl.judge") -> Judge:
    """`{"kind": "rule", "metric": "em"|"f1"}` (the default), `{"kind": "genrm", "prompt":
    ..., **ClientConfig fields}` (base_url, model, api_key_env, limits), or `{"kind":
    "my_pkg.mod:MyJudge", **its keywords}` (`rewards/registry.py`)."""
    spec = dict(spec or {"kind": "rule"})
    kind = spec.pop("kind", "rule")
    try:
        return JUDGES.get(kind, f"{where}.kind")(**spec)
    except TypeError as e:  # a keyword the judge does not take
        raise ValueError(f"{where}: {e}") from e


def build_rubric(spec: dict[str, Any] | None, where: str = "rl.rubric") -> TurnScorer | None:
    """None for an empty spec (no rubric scores); `{"kind": "rule", "max_summary_chars": ...,
    "rubrics": [files]}` (`world_rubric.py`: rules over the question's known path, no model),
    `{"kind": "llm", **ClientConfig fields}` (the LLM judge; `kind` may be left out), or
    `{"kind": "my_pkg.mod:MyScorer", **its keywords}` (`rewards/registry.py`)."""
    if not spec:
        return None
    spec = dict(spec)
    kind = spec.pop("kind", "llm")
    try:
        return RUBRICS.get(kind, f"{where}.kind")(**spec)
    except TypeError as e:  # a keyword the scorer does not take
        raise ValueError(f"{where}: {e}") from e
