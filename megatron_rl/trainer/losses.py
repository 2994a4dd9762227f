"""The plain language-model loss (the loss protocol is `records.batch.LossFn`)."""

from __future__ import annotations

import torch

from megatron_rl.records.batch import LossOutput, TokenBatch


def lm_loss(logprobs: torch.Tensor, entropy: torch.Tensor, batch: TokenBatch) -> LossOutput:
    """Next-token negative log-likelihood over the masked targets (SFT / pre-training)."""
    mask = batch.loss_mask
    nll = -(logprobs * mask).sum()
    return LossOutput(nll, mask.sum().to(torch.int),
                      {"entropy": (entropy.detach() * mask).sum()})
