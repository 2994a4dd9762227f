"""`shape_rewards`: DAPO's overlong penalty written into the judged outcome (and recorded),
trajectories without an outcome left alone; numbers by hand in the comments."""

from __future__ import annotations

import pytest

from megatron_rl.records.trajectory import Trajectory, Turn
from megatron_rl.rewards.shaping import shape_rewards


def _traj(uid: str, generated: list[int], outcome: float | None) -> Trajectory:
    """One trajectory whose turns generate `generated[k]` tokens each."""
    turns = [Turn("agent", [1, 2], [7] * n, [-0.1] * n, [0] * n) for n in generated]
    return Trajectory(uid, "g", "q", "a", turns,
                      rewards={} if outcome is None else {"outcome": outcome})


def test_overlong_penalty_is_added_to_the_outcome():
    # budget 100, buffer 20: free up to 80 generated tokens, then (80 - L) / 20, -1 past 100
    short = _traj("s", [30, 40], 1.0)          # 70 tokens: no penalty
    ramp = _traj("r", [50, 40], 1.0)           # 90 tokens over two turns: -0.5
    over = _traj("o", [120], 0.0)              # past the budget: -1
    shape_rewards([short, ramp, over], overlong_budget=100, overlong_buffer=20)
    assert short.rewards == {"outcome": 1.0, "overlong_penalty": 0.0}
    assert ramp.rewards == {"outcome": pytest.approx(0.5), "overlong_penalty": -0.5}
    assert over.rewards == {"outcome": -1.0, "overlong_penalty": -1.0}


def test_unjudged_trajectories_and_a_zero_buffer_are_untouched():
    unjudged = _traj("u", [95], None)          # e.g. an environment failure: no outcome
    shape_rewards([unjudged], overlong_budget=100, overlong_buffer=20)
    assert unjudged.rewards == {}
    off = _traj("f", [95], 1.0)
    shape_rewards([off], overlong_budget=100, overlong_buffer=0)  # the penalty off
    assert off.rewards == {"outcome": 1.0}
    # a buffer longer than the budget ramps over the whole budget: 60 of 50 -> -1
    long = _traj("l", [60], 1.0)
    shape_rewards([long], overlong_budget=50, overlong_buffer=80)
    assert long.rewards == {"outcome": 0.0, "overlong_penalty": -1.0}
