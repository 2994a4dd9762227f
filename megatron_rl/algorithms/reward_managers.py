"""The reward managers, selectable by name: `turn_advantages(name, trajectories, ...)` returns
per-turn advantages (None = not trained) and metrics for one batch of groups.

| name | reward | normalised over |
|---|---|---|
| `grpo`, `end_to_end` | w_outcome * outcome, the same on every turn | the group's trajectories |
| `rdpo` | per turn: w_outcome * outcome + w_rubric * rubric_k | (group, role) turn pools |
| `rdpo_mixed` | as `rdpo` | the group's turns, roles mixed |
| `pipeline_outcome` | per turn: w_outcome * outcome | (group, role) turn pools |
| `c_grpo` | w_outcome * outcome + w_process * process | the group's trajectories |
| `intermediate_fact` | w_outcome * outcome + w_fact * fact recall | the group's trajectories |
| `intermediate_fact_turn` | per turn: w_outcome * outcome + w_fact * fact_k | (group, role) pools |

The normaliser is any estimator of `advantages.py` (grpo, dr_grpo, rloo); a trajectory-level
advantage is broadcast to every turn. Exclusion follows `trajectory_flags` for every manager:
environment failures (and trajectories without an outcome) are out of the statistics and get
None on every turn; `exclude_max_turns_from_loss` keeps `max_turns` in the statistics but
gives it None.

C-GRPO's process score and the intermediate-fact recall are rewards, written on the
trajectories by `rewards/process.py` (the driver runs the writers a manager lists in `needs`);
the managers here only normalise them. In the per-turn fact variant, fact_k =
turn.rewards["fact"] is the share of the facts turn k surfaced first.

Add a manager with `@REWARD_MANAGERS.register("name")` (or name a function by import path in
`rl.reward_manager`): `fn(trajectories, *, estimator, exclude_max_turns_from_loss,
outcome_weight, rubric_weight, process_weight, fact_weight) -> (per-turn advantages, metrics)`,
with an optional `needs` attribute naming the reward writers it reads (`REWARD_WRITERS` of
`rewards/process.py`).

Metrics: `adv/excluded_fraction`, `adv/masked_fraction` (per trajectory), and over the turns
of counted trajectories `reward/<role>_mean` and `reward/<role>_std` (population std) of the
reward each turn was normalised with; c_grpo adds `reward/process_mean` and the three checks'
means, intermediate_fact and intermediate_fact_turn add `reward/fact_recall`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from megatron_rl.algorithms.advantages import Estimator, group_normalize, trajectory_flags
from megatron_rl.algorithms.rdpo import TurnAdvantages, rdpo_advantages
from megatron_rl.records.trajectory import Trajectory
from megatron_rl.rewards.composite import RewardWeights, turn_rewards
from megatron_rl.utils.registry import Registry

REWARD_MANAGERS = Registry("reward_manager")
Result = tuple[list[TurnAdvantages], dict[str, float]]


def reward_manager(name: str, needs: tuple[str, ...] = ()) -> Callable[[Any], Any]:
    """Register a manager; `needs`: the reward writers (`rewards.process`) it reads."""
    def add(fn: Any) -> Any:
        fn.needs = needs
        return REWARD_MANAGERS.register(name)(fn)
    return add


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _role_metrics(trajectories: Sequence[Trajectory], rewards: Sequence[list[float] | None]
                  ) -> dict[str, float]:
    by_role: dict[str, list[float]] = {}
    for traj, rs in zip(trajectories, rewards, strict=True):
        for turn, r in zip(traj.turns, rs, strict=True) if rs is not None else ():
            by_role.setdefault(turn.role, []).append(r)
    out = {}
    for role, xs in by_role.items():
        m = _mean(xs)
        out[f"reward/{role}_mean"] = m
        out[f"reward/{role}_std"] = math.sqrt(_mean([(x - m) ** 2 for x in xs]))
    return out


def _exclusion(trajectories: Sequence[Trajectory], exclude_max_turns_from_loss: bool
               ) -> tuple[list[bool], list[bool], dict[str, float]]:
    in_stats, in_loss = trajectory_flags(trajectories, "outcome", exclude_max_turns_from_loss)
    n = max(len(trajectories), 1)
    return in_stats, in_loss, {"adv/excluded_fraction": sum(not s for s in in_stats) / n,
                               "adv/masked_fraction": sum(not m for m in in_loss) / n}


def _per_role(trajectories: Sequence[Trajectory], *, mixed: bool, rubric_weight: float,
              estimator: Estimator = "grpo", exclude_max_turns_from_loss: bool = False,
              outcome_weight: float = 1.0, **_: Any) -> Result:
    in_stats, _, metrics = _exclusion(trajectories, exclude_max_turns_from_loss)
    weights = RewardWeights(outcome_weight, rubric_weight)
    adv = rdpo_advantages(trajectories, weights, mixed_roles=mixed, estimator=estimator,
                          exclude_max_turns_from_loss=exclude_max_turns_from_loss)
    turn_values = [turn_rewards(t, weights) if s else None
                   for t, s in zip(trajectories, in_stats, strict=True)]
    return adv, {**metrics, **_role_metrics(trajectories, turn_values)}


@reward_manager("rdpo")
def rdpo(trajectories: Sequence[Trajectory], *, rubric_weight: float = 1.0, **kw: Any) -> Result:
    """Per turn: w_outcome * outcome + w_rubric * rubric, normalised per (group, role)."""
    return _per_role(trajectories, mixed=False, rubric_weight=rubric_weight, **kw)


@reward_manager("rdpo_mixed")
def rdpo_mixed(trajectories: Sequence[Trajectory], *, rubric_weight: float = 1.0,
               **kw: Any) -> Result:
    """RDPO's rewards normalised over the group's turns with roles mixed (the ablation)."""
    return _per_role(trajectories, mixed=True, rubric_weight=rubric_weight, **kw)


@reward_manager("pipeline_outcome")
def pipeline_outcome(trajectories: Sequence[Trajectory], **kw: Any) -> Result:
    """The outcome on every turn, normalised per (group, role)."""
    kw.pop("rubric_weight", None)
    return _per_role(trajectories, mixed=False, rubric_weight=0.0, **kw)


def _trajectory_level(trajectories: Sequence[Trajectory], bonus: Sequence[float],
                      in_stats: list[bool], in_loss: list[bool], metrics: dict[str, float], *,
                      estimator: Estimator, outcome_weight: float) -> Result:
    values = [outcome_weight * t.rewards["outcome"] + b if s else 0.0
              for t, b, s in zip(trajectories, bonus, in_stats, strict=True)]
    adv = group_normalize(values, [t.group_id for t in trajectories], in_stats,
                          estimator=estimator)
    out = [[a if trained else None] * len(t.turns)
           for t, a, trained in zip(trajectories, adv, in_loss, strict=True)]
    turn_values = [[v] * len(t.turns) if s else None
                   for t, v, s in zip(trajectories, values, in_stats, strict=True)]
    return out, {**metrics, **_role_metrics(trajectories, turn_values)}


@reward_manager("grpo")
def grpo(trajectories: Sequence[Trajectory], *, estimator: Estimator = "grpo",
         exclude_max_turns_from_loss: bool = False, outcome_weight: float = 1.0,
         **_: Any) -> Result:
    """w_outcome * outcome, normalised over the group, the same on every turn."""
    in_stats, in_loss, metrics = _exclusion(trajectories, exclude_max_turns_from_loss)
    return _trajectory_level(trajectories, [0.0] * len(trajectories), in_stats, in_loss,
                             metrics, estimator=estimator, outcome_weight=outcome_weight)


REWARD_MANAGERS.register("end_to_end")(grpo)


@reward_manager("c_grpo", needs=("process",))
def c_grpo(trajectories: Sequence[Trajectory], *, estimator: Estimator = "grpo",
           exclude_max_turns_from_loss: bool = False, outcome_weight: float = 1.0,
           process_weight: float = 0.5, **_: Any) -> Result:
    """w_outcome * outcome + w_process * process (`rewards["process"]`), over the group."""
    in_stats, in_loss, metrics = _exclusion(trajectories, exclude_max_turns_from_loss)
    counted = [t for t, s in zip(trajectories, in_stats, strict=True) if s]
    bonus = [process_weight * t.rewards["process"] if s else 0.0
             for t, s in zip(trajectories, in_stats, strict=True)]
    metrics.update({f"reward/{k}_mean": _mean([t.rewards[k] for t in counted])
                    for k in ("process", "retrieval", "evidence", "grounding")})
    return _trajectory_level(trajectories, bonus, in_stats, in_loss, metrics,
                             estimator=estimator, outcome_weight=outcome_weight)


@reward_manager("intermediate_fact", needs=("facts",))
def intermediate_fact(trajectories: Sequence[Trajectory], *, estimator: Estimator = "grpo",
                      exclude_max_turns_from_loss: bool = False, outcome_weight: float = 1.0,
                      fact_weight: float = 0.5, **_: Any) -> Result:
    """w_outcome * outcome + w_fact * fact recall (`rewards["fact_recall"]`, 0 without
    facts), over the group."""
    in_stats, in_loss, metrics = _exclusion(trajectories, exclude_max_turns_from_loss)
    recall = [t.rewards.get("fact_recall") if s else None
              for t, s in zip(trajectories, in_stats, strict=True)]
    bonus = [fact_weight * (r or 0.0) for r in recall]
    metrics["reward/fact_recall"] = _mean([r for r in recall if r is not None])
    return _trajectory_level(trajectories, bonus, in_stats, in_loss, metrics,
                             estimator=estimator, outcome_weight=outcome_weight)


@reward_manager("intermediate_fact_turn", needs=("facts",))
def intermediate_fact_turn(trajectories: Sequence[Trajectory], *,
                           estimator: Estimator = "grpo",
                           exclude_max_turns_from_loss: bool = False,
                           outcome_weight: float = 1.0, fact_weight: float = 0.5,
                           **_: Any) -> Result:
    """Per turn: w_outcome * outcome + w_fact * the share of facts the turn surfaced first
    (`turn.rewards["fact"]`), normalised per (group, role)."""
    in_stats, in_loss, metrics = _exclusion(trajectories, exclude_max_turns_from_loss)
    turn_values: list[list[float] | None] = []
    values, keys, include = [], [], []
    for traj, counted in zip(trajectories, in_stats, strict=True):
        base = outcome_weight * traj.rewards["outcome"] if counted else 0.0
        rs = [base + fact_weight * turn.rewards.get("fact", 0.0) if counted else 0.0
              for turn in traj.turns]
        turn_values.append(rs if counted else None)
        values += rs
        keys += [(traj.group_id, turn.role) for turn in traj.turns]
        include += [counted] * len(traj.turns)
    flat = iter(group_normalize(values, keys, include, estimator=estimator))
    adv = [[a if trained else None for a in [next(flat) for _ in t.turns]]
           for t, trained in zip(trajectories, in_loss, strict=True)]
    recall = [t.rewards.get("fact_recall") for t, s in zip(trajectories, in_stats, strict=True)
              if s]
    metrics["reward/fact_recall"] = _mean([r for r in recall if r is not None])
    return adv, {**metrics, **_role_metrics(trajectories, turn_values)}


def turn_advantages(name: str, trajectories: Sequence[Trajectory], **kw: Any) -> Result:
    """Per-turn advantages of reward manager `name` (registered, or an import path) and its
    metrics; keywords: estimator, exclude_max_turns_from_loss and the reward weights."""
    return REWARD_MANAGERS.get(name, "rl.reward_manager")(list(trajectories), **kw)


def needs(name: str) -> tuple[str, ...]:
    """The reward writers manager `name` reads."""
    return tuple(getattr(REWARD_MANAGERS.get(name, "rl.reward_manager"), "needs", ()))
