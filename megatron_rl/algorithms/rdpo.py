"""Per-turn advantages for multi-turn agents, and their mapping onto training tokens.

RDPO (IterSynth's role-decoupled policy optimisation): every turn gets the composite reward of
`rewards.composite.turn_rewards`, outcome x w_outcome + that turn's rubric x w_rubric (a turn
without a rubric score gets the outcome part only). Turns are pooled by (group, role), so the
Planner's turns are normalised against the Planner turns of the same prompt's trajectories and
the Synthesizer's against the Synthesizer's, never across roles. `mixed_roles=True` pools all
turns of a group together (the paper's ablation).

The other reward managers (outcome-only per role pool, end to end, C-GRPO, ...) are in
`reward_managers.py`.

Per-turn results are `list[float | None]` per trajectory; None means "not trained" (environment
failure, or `max_turns` with `exclude_max_turns_from_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_rl.algorithms.advantages import (
    Estimator,
    group_normalize,
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


@dataclass
class SequenceAdvantages:
    advantages: np.ndarray  # float, aligned with TrainingSequence.tokens; 0 off generated tokens
    loss_mask: np.ndarray   # int, the sequence's mask, with untrained turns zeroed


def token_advantages(sequences: Sequence[TrainingSequence], turn_advantages: TurnAdvantages
                     ) -> list[SequenceAdvantages]:
    """Each generated token gets its turn's advantage (via `turn_index`); context and
    observation tokens get 0, and tokens of a turn whose advantage is None leave the mask."""
    # per turn, then one lookup per token (index -1, context and observations, hits the
    # appended untrained entry); a loop over the tokens took ~1 us each
    value = np.array([0.0 if a is None else float(a) for a in turn_advantages] + [0.0])
    trained = np.array([a is not None for a in turn_advantages] + [False])
    out = []
    for seq in sequences:
        turn = np.array(seq.turn_index, dtype=np.int64)
        if len(turn) != len(seq.loss_mask):
            raise ValueError(f"{len(turn)} turn indices but a loss mask of "
                             f"{len(seq.loss_mask)}")
        mask = np.where(trained[turn], np.array(seq.loss_mask, dtype=np.int64), 0)
        out.append(SequenceAdvantages(value[turn], mask))  # arrays: the batch takes them as is
    return out
