"""Group-relative advantage estimators over scalar rewards (GRPO, Dr.GRPO, RLOO), DAPO's
dynamic-sampling filter, and which trajectories enter the statistics and the loss.

A group is the trajectories of one prompt (`Trajectory.group_id`). Everything here is plain
Python on small lists (one float per trajectory or turn); token-level work is in
`policy_loss.py`.

Estimators, for the included members r_1..r_n of one group (mean m, std s):
- `grpo`:    A_i = (r_i - m) / (s + eps). `unbiased_std=True` uses n-1 in s (torch.std's and
  TRL/verl's default); False uses n (numpy's default). A group of one has s = 0.
- `dr_grpo`: A_i = r_i - m (Dr.GRPO drops the std division; pair it with a loss aggregation
  without per-sequence length normalisation, see `policy_loss.py`).
- `rloo`:    A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - m); 0 for a group of one.

Exclusion (the trajectory taxonomy): environment failures, and trajectories with no reward
(e.g. `judge_error`), leave the group statistics and get no advantage (out of the loss). Model
failures stay in with their reward. `exclude_max_turns_from_loss=True` keeps `max_turns`
trajectories in the statistics but masks them out of the loss.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from megatron_rl.records.trajectory import Trajectory

Estimator = Literal["grpo", "dr_grpo", "rloo"]
ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def _groups(keys: Sequence[Hashable], include: Sequence[bool]) -> dict[Hashable, list[int]]:
    """Indices of the included items by key, in first-seen order."""
    out: dict[Hashable, list[int]] = {}
    for i, (key, inc) in enumerate(zip(keys, include, strict=True)):
        if inc:
            out.setdefault(key, []).append(i)
    return out


def _std(xs: Sequence[float], mean: float, unbiased: bool) -> float:
    dof = len(xs) - 1 if unbiased else len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / dof) if dof > 0 else 0.0


def group_normalize(values: Sequence[float], keys: Sequence[Hashable],
                    include: Sequence[bool] | None = None, *, estimator: Estimator = "grpo",
                    unbiased_std: bool = True, eps: float = 1e-6) -> list[float]:
    """Advantages of `values` relative to the other included values with the same key.

    Items with `include[i] = False` are left out of every statistic and get 0.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}: one of {', '.join(ESTIMATORS)}")
    include = [True] * len(values) if include is None else include
    out = [0.0] * len(values)
    for idx in _groups(keys, include).values():
        xs = [float(values[i]) for i in idx]
        if not all(math.isfinite(x) for x in xs):
            raise ValueError(f"non-finite reward in group {keys[idx[0]]!r}: {xs}")
        n, mean = len(xs), sum(xs) / len(xs)
        if estimator == "rloo":
            scale = n / (n - 1) if n > 1 else 0.0
        elif estimator == "grpo":
            denom = _std(xs, mean, unbiased_std) + eps
            scale = 1.0 / denom if denom > 0 else 0.0  # eps = 0, constant group: r - m = 0
        else:
            scale = 1.0
        for i, x in zip(idx, xs, strict=True):
            out[i] = (x - mean) * scale
    return out


def trajectory_flags(trajectories: Sequence[Trajectory], reward_key: str = "outcome",
                     exclude_max_turns_from_loss: bool = False
                     ) -> tuple[list[bool], list[bool]]:
    """(in_stats, in_loss) per trajectory, following the taxonomy (see the module doc)."""
    in_stats = [not t.env_failure and reward_key in t.rewards for t in trajectories]
    in_loss = [s and not (exclude_max_turns_from_loss and "max_turns" in t.labels)
               for s, t in zip(in_stats, trajectories, strict=True)]
    return in_stats, in_loss


@dataclass
class DynamicSampling:
    keep: list[bool]             # per item: its group has reward variance
    kept_groups: list[Hashable]
    dropped_groups: list[Hashable]

    @property
    def num_dropped(self) -> int:
        return len(self.dropped_groups)


def dynamic_sampling_filter(rewards: Sequence[float], group_ids: Sequence[Hashable],
                            include: Sequence[bool] | None = None, tol: float = 0.0
                            ) -> DynamicSampling:
    """DAPO dynamic sampling: drop groups whose included rewards all agree (max - min <= tol),
    since every advantage in them is 0 and they only dilute the batch. A group with fewer than
    two included members (or none) has no variance either and is dropped. The scheduler
    over-samples `num_dropped` prompts to refill the batch."""
    include = [True] * len(rewards) if include is None else include
    members = _groups(group_ids, include)
    kept, dropped = [], []
    for gid in dict.fromkeys(group_ids):  # every group, in first-seen order
        xs = [rewards[i] for i in members.get(gid, [])]
        (kept if len(xs) > 1 and max(xs) - min(xs) > tol else dropped).append(gid)
    keep_set = set(kept)
    return DynamicSampling([g in keep_set for g in group_ids], kept, dropped)
