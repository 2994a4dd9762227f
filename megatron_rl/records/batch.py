"""The trainer's input and a loss's output: right-padded token rows with a per-target loss
mask, the per-token extras that ride along, and the loss protocol the actor trains with.

A loss sees one micro-batch: per-token log-probs and entropy (already reduced over TP) plus the
`TokenBatch`. It returns a *sum* over its tokens and a normaliser count; the actor divides by
the global count of the whole step, so every layout trains on the same objective.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Protocol

import torch

# `TokenBatch.extras` keys, [rows, seq] aligned with the labels unless noted
ADVANTAGES = "advantages"
ROLLOUT_LOGPROBS = "rollout_logprobs"     # the engine's, as sampled
OLD_LOGPROBS = "old_logprobs"             # the trainer's, before the step's first update
REF_LOGPROBS = "ref_logprobs"             # the KL reference policy's
IS_WEIGHTS = "rollout_is_weights"         # truncated importance-sampling weights
ROUTED_EXPERTS = "routed_experts"         # [rows, seq, layers, top_k] long, aligned with inputs
NOT_ROUTED = -1                           # routed_experts entry of a token the engine never saw


@dataclass
class TokenBatch:
    """`input_ids[i, t]` predicts `labels[i, t]`; `loss_mask` selects the trained targets.

    Extra per-token tensors (advantages, rollout log-probs, ...) ride along in `extras`, all
    shaped [rows, seq], so losses read them without the trainer knowing what they are.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        if self.input_ids.dim() != 2:
            raise ValueError(f"TokenBatch.input_ids must be [rows, seq], got {tuple(shape)}")
        for name in ("labels", "loss_mask", "position_ids"):
            t = getattr(self, name)
            if t is not None and t.shape != shape:
                raise ValueError(f"TokenBatch.{name} has shape {tuple(t.shape)}, "
                                 f"input_ids has {tuple(shape)}")
        for name, t in self.extras.items():
            if t.shape[:2] != shape:
                raise ValueError(f"TokenBatch.extras[{name!r}] has shape {tuple(t.shape)}, "
                                 f"expected leading {tuple(shape)}")
        if self.position_ids is None:
            self.position_ids = torch.arange(shape[1]).expand(shape).contiguous()
        self.loss_mask = self.loss_mask.float()

    @classmethod
    def from_sequences(cls, tokens: torch.Tensor, loss_mask: torch.Tensor | None = None,
                       **extras: torch.Tensor) -> TokenBatch:
        """Next-token batch from full sequences [rows, seq+1]; mask aligned to the targets."""
        mask = torch.ones_like(tokens[:, 1:]) if loss_mask is None else loss_mask[:, 1:]
        return cls(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask,
                   extras={k: v[:, 1:].contiguous() for k, v in extras.items()})

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_length(self) -> int:
        return self.input_ids.shape[1]

    def select(self, rows: slice | torch.Tensor) -> TokenBatch:
        """These rows (a plain TokenBatch, also when called on a subclass)."""
        kw = {f.name: getattr(self, f.name) for f in fields(TokenBatch) if f.name != "extras"}
        kw = {k: v[rows] for k, v in kw.items()}
        return TokenBatch(**kw, extras={k: v[rows] for k, v in self.extras.items()})

    def shard(self, rank: int, world: int) -> TokenBatch:
        if self.rows % world:
            raise ValueError(f"batch of {self.rows} rows does not split over {world} DP ranks")
        n = self.rows // world
        return self.select(slice(rank * n, (rank + 1) * n))

    def micro_batches(self, size: int) -> list[TokenBatch]:
        if self.rows % size:
            raise ValueError(f"{self.rows} rows do not split into micro-batches of {size}")
        return [self.select(slice(i, i + size)) for i in range(0, self.rows, size)]


@dataclass
class LossOutput:
    loss_sum: torch.Tensor
    num_tokens: torch.Tensor  # int: what this micro-batch adds to the global normaliser
    # sums aggregated as the loss is, reported divided by the global `num_tokens`
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    # sums over trained tokens, reported divided by the global count of trained tokens
    # (`masked_tokens`): token means whatever the loss's aggregation (verl's pg_clipfrac, ...)
    token_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    masked_tokens: torch.Tensor | None = None


class LossFn(Protocol):
    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor,
                 batch: TokenBatch) -> LossOutput: ...
