"""Rollouts → the trainer's `TokenBatch`.

Each `TrainingSequence` becomes one right-padded row; its per-token advantages and the engine's
log-probs ride along as `extras` (shifted with the targets by `TokenBatch.from_sequences`).
With MoE routing replay the engine's routed experts ride along too (`extras["routed_experts"]`,
[rows, seq, layers, top_k] long, aligned with the *inputs*; -1 where the engine never saw a
token) when every sequence has them.
Rows are padded up to a multiple (data-parallel ranks × micro-batch size) with fully masked
rows, which add nothing to a loss sum nor to its token or sequence count.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megatron_rl.algorithms.rdpo import SequenceAdvantages, token_advantages
from megatron_rl.algorithms.reward_managers import turn_advantages
from megatron_rl.config.schema import RLConfig
from megatron_rl.records.batch import (
    ADVANTAGES,
    NOT_ROUTED,
    ROLLOUT_LOGPROBS,
    ROUTED_EXPERTS,
    TokenBatch,
)
from megatron_rl.records.trajectory import TrainingSequence, Trajectory


def build_batch(sequences: Sequence[TrainingSequence], advantages: Sequence[SequenceAdvantages],
                *, seq_length: int, pad_id: int, rows_multiple: int = 1,
                fit_multiple: int | None = None) -> TokenBatch:
    """A [rows, seq_length] batch; a sequence longer than seq_length + 1 tokens is an error
    naming it (the agent's context limit should have stopped it). `fit_multiple` (the
    trainer's sequence multiple): only as many positions as the longest sequence needs,
    rounded up to it; a step of short episodes then ships and pads no 1,024-wide rows."""
    if len(sequences) != len(advantages):
        raise ValueError(f"{len(sequences)} sequences but {len(advantages)} advantage rows")
    if not sequences:
        raise ValueError("no sequences to train on")
    width = seq_length + 1
    if fit_multiple:  # the inputs (a token fewer) rounded up, and the last target
        inputs = max(len(s.tokens) for s in sequences) - 1
        width = min(width, -(-inputs // fit_multiple) * fit_multiple + 1)
    rows = -(-len(sequences) // rows_multiple) * rows_multiple
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, width)
    adv = torch.zeros(rows, width)
    rollout = torch.zeros(rows, width)
    for i, (seq, a) in enumerate(zip(sequences, advantages, strict=True)):
        n = len(seq.tokens)
        if n > width:
            raise ValueError(f"sequence {i} has {n} tokens; model.seq_length={seq_length} "
                             f"holds {width} (inputs + the last target)")
        if len(a.advantages) != n or len(a.loss_mask) != n:
            raise ValueError(f"sequence {i}: {n} tokens but {len(a.advantages)} advantages")
        # through numpy: torch.tensor(list) takes ~8x as long for the same values
        tokens[i, :n] = torch.from_numpy(np.array(seq.tokens, dtype=np.int64))
        mask[i, :n] = torch.from_numpy(np.asarray(a.loss_mask, dtype=np.float32))
        adv[i, :n] = torch.from_numpy(np.asarray(a.advantages, dtype=np.float32))
        rollout[i, :n] = torch.from_numpy(np.array(seq.logprobs, dtype=np.float32))
    batch = TokenBatch.from_sequences(tokens, mask, **{ADVANTAGES: adv, ROLLOUT_LOGPROBS: rollout})
    if all(s.routed_experts is not None for s in sequences):
        batch.extras[ROUTED_EXPERTS] = routed_experts(sequences, rows, width)[:, :-1]
    return batch


def routed_experts(sequences: Sequence[TrainingSequence], rows: int, width: int) -> torch.Tensor:
    """[rows, width, *per-token shape] expert ids; -1 for tokens without routing and padding."""
    shape = next((np.shape(r) for s in sequences for r in s.routed_experts if r is not None),
                 None)
    if shape is None:
        raise ValueError("routing replay: no sequence has any routed token")
    out = torch.full((rows, width, *shape), NOT_ROUTED, dtype=torch.long)
    for i, seq in enumerate(sequences):
        have = [t for t, r in enumerate(seq.routed_experts) if r is not None]
        if have:  # one array through numpy: torch.tensor on a list of per-token arrays took
            # 208 ms for 4,096 tokens x 40 layers x top-8 (np.stack: 7 ms)
            out[i, have] = torch.from_numpy(
                np.stack([seq.routed_experts[t] for t in have])).long()
    return out


def rl_batch(trajectories: Sequence[Trajectory], rl: RLConfig, *, seq_length: int,
             rows_multiple: int, pad_id: int = 0, fit_multiple: int | None = None
             ) -> tuple[TokenBatch | None, dict[str, float]]:
    """A step's judged (and shaped, `rewards.shaping`) trajectories → per-turn advantages
    (`rl.reward_manager`) → the trainer's batch (`build_batch`); None when no sequence was
    generated (e.g. every prompt overflowed the context)."""
    per_turn, metrics = turn_advantages(
        rl.reward_manager, trajectories, estimator=rl.estimator,
        exclude_max_turns_from_loss=rl.exclude_max_turns_from_loss,
        rubric_weight=rl.rubric_weight)
    seqs, per_token = [], []
    for traj, advantages in zip(trajectories, per_turn, strict=True):
        roles = traj.metadata.get("trained_roles")
        if roles is not None:  # a group dynamic sampling dropped: only these roles train
            advantages = [a if turn.role in roles else None
                          for a, turn in zip(advantages, traj.turns, strict=True)]
        # kept with the trajectory: the dump (and the trajectory viewer) shows them per turn
        traj.metadata["turn_advantages"] = [None if a is None else round(float(a), 6)
                                            for a in advantages]
        own = traj.sequences()
        for seq, adv in zip(own, token_advantages(own, advantages), strict=True):
            if adv.loss_mask.any():  # a row with no trained token adds nothing but work
                seqs.append(seq)
                per_token.append(adv)
    stale = [v for s in seqs for v, m in zip(s.weight_versions, s.loss_mask, strict=True) if m]
    if stale:
        newest = max(stale)
        metrics["rollout/stale_token_fraction"] = sum(v < newest for v in stale) / len(stale)
    if not seqs:
        return None, metrics
    return build_batch(seqs, per_token, seq_length=seq_length, pad_id=pad_id,
                       rows_multiple=rows_multiple, fit_multiple=fit_multiple), metrics
