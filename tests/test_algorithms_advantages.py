"""Group-relative advantages, exclusion flags and DAPO dynamic sampling on hand-computed
cases."""

from __future__ import annotations

import math

import pytest

from megatron_rl.algorithms.advantages import (
    dynamic_sampling_filter,
    group_normalize,
    trajectory_flags,
)
from megatron_rl.algorithms.reward_managers import turn_advantages
from megatron_rl.records.trajectory import Trajectory, Turn


def _traj(uid: str, group: str, outcome: float | None, *labels: str) -> Trajectory:
    t = Trajectory(uid, group, "q", turns=[Turn("agent", [1], [2], [-0.5], [0])],
                   rewards={} if outcome is None else {"outcome": outcome})
    for label in labels:
        t.add_label(label)
    return t


def test_grpo_unbiased_and_biased_std():
    # group [1, 0, 0, 1]: mean 0.5, squared deviations 4 * 0.25 = 1
    # unbiased s = sqrt(1/3) = 0.57735 -> A = +-0.5 / 0.57735 = +-0.866025
    # biased   s = sqrt(1/4) = 0.5     -> A = +-1
    r, g = [1.0, 0.0, 0.0, 1.0], ["a"] * 4
    assert group_normalize(r, g, eps=0.0) == pytest.approx([0.866025, -0.866025,
                                                            -0.866025, 0.866025], abs=1e-6)
    assert group_normalize(r, g, eps=0.0, unbiased_std=False) == pytest.approx([1, -1, -1, 1])


def test_groups_are_independent_and_estimators_differ():
    r = [1.0, 0.0, 0.0, 1.0, 2.0, 4.0]
    g = ["a", "a", "a", "a", "b", "b"]
    # Dr.GRPO: r - mean; group a mean 0.5, group b mean 3
    assert group_normalize(r, g, estimator="dr_grpo") == [0.5, -0.5, -0.5, 0.5, -1.0, 1.0]
    # RLOO: r_0 = 1 against mean(0, 0, 1) = 1/3 -> 2/3; r_1 = 0 against 2/3 -> -2/3
    # group b: 2 - 4 = -2, 4 - 2 = 2  (= n/(n-1) * (r - m) = 2 * -+1)
    assert group_normalize(r, g, estimator="rloo") == pytest.approx(
        [2 / 3, -2 / 3, -2 / 3, 2 / 3, -2.0, 2.0])
    # GRPO group b: s = sqrt((1 + 1) / 1) = 1.41421 -> -+1 / 1.41421 = -+0.707107
    assert group_normalize(r, g, eps=0.0)[4:] == pytest.approx([-0.707107, 0.707107], abs=1e-6)


def test_singleton_and_constant_groups_give_zero():
    assert group_normalize([3.0], ["a"]) == [0.0]                 # s = 0, r - m = 0
    assert group_normalize([3.0], ["a"], estimator="rloo") == [0.0]
    assert group_normalize([1.0, 1.0], ["a", "a"]) == [0.0, 0.0]  # 0 / (0 + eps)
    assert group_normalize([1.0, 1.0], ["a", "a"], eps=0.0) == [0.0, 0.0]  # no 0 / 0


def test_bad_input():
    with pytest.raises(ValueError, match="estimator"):
        group_normalize([1.0], ["a"], estimator="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-finite"):
        group_normalize([1.0, math.nan], ["a", "a"])


def test_exclusion_follows_the_taxonomy():
    trajs = [_traj("ok", "g", 1.0),
             _traj("degenerate", "g", 0.0, "degenerate"),      # model failure: stays in
             _traj("search", "g", 1.0, "search_error"),        # env failure: out
             _traj("judge", "g", None, "judge_error"),         # no reward: out
             _traj("turns", "g", 0.0, "max_turns")]            # model failure: stays in
    # statistics over ok, degenerate, turns = [1, 0, 0], mean 1/3 (Dr.GRPO: r - 1/3)
    adv, metrics = turn_advantages("grpo", trajs, estimator="dr_grpo")
    assert [a[0] for a in adv] == pytest.approx([2 / 3, -1 / 3, None, None, -1 / 3])
    assert trajectory_flags(trajs) == ([True, True, False, False, True],) * 2
    # the switch keeps max_turns in the mean (still 1/3) but out of the loss
    adv, metrics = turn_advantages("grpo", trajs, estimator="dr_grpo",
                                   exclude_max_turns_from_loss=True)
    assert [a[0] for a in adv] == pytest.approx([2 / 3, -1 / 3, None, None, None])
    assert metrics["adv/excluded_fraction"] == 0.4 and metrics["adv/masked_fraction"] == 0.6


def test_dynamic_sampling_drops_zero_variance_groups():
    rewards = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.5]
    groups = ["a", "a", "a", "b", "b", "c", "c", "d", "d"]
    include = [True] * 6 + [False] + [True] * 2  # c keeps one member: no variance
    res = dynamic_sampling_filter(rewards, groups, include)
    assert res.kept_groups == ["b"]
    assert res.dropped_groups == ["a", "c", "d"] and res.num_dropped == 3
    assert res.keep == [False] * 3 + [True] * 2 + [False] * 4
    # a tolerance treats near-equal rewards as equal
    assert dynamic_sampling_filter([0.5, 0.5 + 1e-9], ["x", "x"], tol=1e-6).num_dropped == 1
