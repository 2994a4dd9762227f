"""Reward shaping after a step's groups are collected: DAPO's soft overlong penalty and the
process rewards a reward manager needs. Rewards are written only in `rewards/`; the
algorithms turn them into advantages."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_rl.records.trajectory import Trajectory
from megatron_rl.rewards.process import REWARD_WRITERS


def overlong_penalty(response_length: int, max_length: int, cache_length: int,
                     factor: float = 1.0) -> float:
    """DAPO soft overlong punishment, added to the reward: 0 up to max_length - cache_length,
    then a linear ramp to -factor at max_length, and -factor beyond it."""
    if not 0 < cache_length <= max_length:
        raise ValueError(f"cache_length={cache_length} must be in (0, max_length={max_length}]")
    expected = max_length - cache_length
    if response_length <= expected:
        return 0.0
    if response_length <= max_length:
        return factor * (expected - response_length) / cache_length
    return -factor


def shape_rewards(trajectories: Sequence[Trajectory], *, needs: Sequence[str] = (),
                  overlong_budget: int = 0, overlong_buffer: int = 0) -> None:
    """Run the reward writers `needs` names, then, with `overlong_buffer`, add DAPO's soft
    overlong penalty (on the trajectory's generated tokens, against `overlong_budget`) to
    each judged outcome; `rewards["overlong_penalty"]` records it."""
    for name in needs:
        if name not in REWARD_WRITERS:
            raise ValueError(f"reward writer {name!r}: one of {', '.join(REWARD_WRITERS)}")
        REWARD_WRITERS[name](trajectories)
    if not overlong_buffer:
        return
    for t in trajectories:
        if "outcome" in t.rewards:
            length = sum(len(turn.output_ids) for turn in t.turns)
            penalty = overlong_penalty(length, overlong_budget,
                                       min(overlong_buffer, overlong_budget))
            t.rewards["overlong_penalty"] = penalty
            t.rewards["outcome"] += penalty
