"""The loss protocol the actor trains with, and the plain language-model loss.

A loss sees one micro-batch: per-token log-probs and entropy (already reduced over TP) plus
the `TokenBatch`. It returns a *sum* over its tokens and the token count; the actor divides by
the global token count of the whole step, so every layout trains on the same objective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatron_rl.trainer.batch import TokenBatch


@dataclass
class LossOutput:
    loss_sum: torch.Tensor
    num_tokens: torch.Tensor  # int, tokens this micro-batch contributes to the global mean
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # token sums, reported / tokens


class LossFn(Protocol):
    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor,
                 batch: TokenBatch) -> LossOutput: ...


def lm_loss(logprobs: torch.Tensor, entropy: torch.Tensor, batch: TokenBatch) -> LossOutput:
    """Next-token negative log-likelihood over the masked targets (SFT / pre-training)."""
    mask = batch.loss_mask
    nll = -(logprobs * mask).sum()
    return LossOutput(nll, mask.sum().to(torch.int),
                      {"entropy": (entropy.detach() * mask).sum()})
