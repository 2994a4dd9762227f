"""Per-turn advantages for multi-turn agents, and their mapping onto training tokens.

RDPO (IterSynth's role-decoupled policy optimisation): every turn gets the composite reward of
`rewards.composite.turn_rewards`, outcome x w_outcome + that turn's rubric x w_rubric (a turn
without a rubric score gets the outcome part only). Turns are pooled by (group, role), so the
Planner's turns are normalised against the Planner turns of the same prompt's trajectories and
the Synthesizer's against the Synthesizer's, never across roles. `mixed_roles=True` pools all
turns of a group together (the paper's ablation).

The simpler reward managers, each a thin wrapper:
- `pipeline_outcome_advantages` (outcome-only, PS pipeline): RDPO with w_rubric = 0, i.e. the
  trajectory's outcome on every turn, normalised per role pool.
- `end_to_end_advantages`: one trajectory-level advantage (GRPO over the group's outcomes),
  the same on every turn; roles are ignored.
- `multi_candidate_advantages`: several candidate answers per prompt, each scored; standard
  GRPO over each prompt's candidates.

Per-turn results are `list[float | None]` per trajectory; None means "not trained" (environment
failure, or `max_turns` with `exclude_max_turns_from_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_rl.algorithms.advantages import (
    Estimator,
    group_normalize,
    trajectory_advantages,
    trajectory_flags,
)
from megatron_rl.records.trajectory import TrainingSequence, Trajectory
from megatron_rl.rewards.composite import RewardWeights, turn_rewards

TurnAdvantages = list[float | None]


def rdpo_advantages(trajectories: Sequence[Trajectory], weights: RewardWeights | None = None,
                    *, mixed_roles: bool = False, estimator: Estimator = "grpo",
                    unbiased_std: bool = True, eps: float = 1e-6,
                    exclude_max_turns_from_loss: bool = False) -> list[TurnAdvantages]:
    """Per-turn advantages, normalised within (group, role) pools (or per group if mixed).

    `weights` defaults to w_outcome = w_rubric = 1.
    """
    weights = weights or RewardWeights(outcome=1.0, rubric=1.0)
    in_stats, in_loss = trajectory_flags(trajectories, "outcome", exclude_max_turns_from_loss)
    values: list[float] = []
    keys: list[tuple[str, ...]] = []
    include: list[bool] = []
    for traj, counted in zip(trajectories, in_stats, strict=True):
        rewards = turn_rewards(traj, weights) if counted else None
        for k, turn in enumerate(traj.turns):
            values.append(rewards[k] if rewards is not None else 0.0)
            keys.append((traj.group_id,) if mixed_roles else (traj.group_id, turn.role))
            include.append(rewards is not None)
    flat = iter(group_normalize(values, keys, include, estimator=estimator,
                                unbiased_std=unbiased_std, eps=eps))
    out: list[TurnAdvantages] = []
    for traj, trained in zip(trajectories, in_loss, strict=True):
        turn_adv = [next(flat) for _ in traj.turns]
        out.append(turn_adv if trained else [None] * len(traj.turns))
    return out


def pipeline_outcome_advantages(trajectories: Sequence[Trajectory], **kw) -> list[TurnAdvantages]:
    """Outcome-only reward for the Planner/Synthesizer pipeline, normalised per role pool."""
    return rdpo_advantages(trajectories, RewardWeights(outcome=1.0, rubric=0.0), **kw)


def end_to_end_advantages(trajectories: Sequence[Trajectory], **kw) -> list[TurnAdvantages]:
    """One GRPO-family advantage per trajectory from its outcome, broadcast to every turn.
    Keyword arguments go to `trajectory_advantages` (estimator, std, exclusion switch)."""
    res = trajectory_advantages(trajectories, **kw)
    return [[a if trained else None] * len(t.turns)
            for t, a, trained in zip(trajectories, res.advantages, res.in_loss, strict=True)]


def multi_candidate_advantages(scores: Sequence[Sequence[float]], **kw) -> list[list[float]]:
    """GRPO over each prompt's scored candidates; `scores[p][c]` is candidate c of prompt p.
    Keyword arguments go to `group_normalize` (estimator, unbiased_std, eps)."""
    flat = [s for cands in scores for s in cands]
    keys = [p for p, cands in enumerate(scores) for _ in cands]
    adv = iter(group_normalize(flat, keys, **kw))
    return [[next(adv) for _ in cands] for cands in scores]


@dataclass
class SequenceAdvantages:
    advantages: list[float]  # aligned with TrainingSequence.tokens; 0 off generated tokens
    loss_mask: list[int]     # the sequence's mask, with untrained turns zeroed


def token_advantages(sequences: Sequence[TrainingSequence], turn_advantages: TurnAdvantages
                     ) -> list[SequenceAdvantages]:
    """Each generated token gets its turn's advantage (via `turn_index`); context and
    observation tokens get 0, and tokens of a turn whose advantage is None leave the mask."""
    out = []
    for seq in sequences:
        adv, mask = [], []
        for i, m in zip(seq.turn_index, seq.loss_mask, strict=True):
            a = turn_advantages[i] if i >= 0 else None
            adv.append(0.0 if a is None else a)
            mask.append(m if a is not None else 0)
        out.append(SequenceAdvantages(adv, mask))
    return out
