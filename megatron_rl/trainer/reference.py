"""The reference policy of the KL penalty: the initial weights, kept as a copy of this rank's
parameter shards and swapped in to compute reference log-probs (no second model is built).
"""

from __future__ import annotations

from typing import Any

import torch


class ReferencePolicy:
    def __init__(self, actor: Any):
        self.weights = {n: p.detach().clone() for n, p in actor.parameters().items()}

    @torch.no_grad()
    def logprobs(self, actor: Any, batch: Any) -> torch.Tensor:
        """Log-probs of `batch.labels` under the reference weights; the actor's own weights
        are back in place afterwards, bit for bit."""
        live = actor.parameters()
        if live.keys() != self.weights.keys():
            raise ValueError("the reference policy was taken from a different model: "
                             f"{sorted(live.keys() ^ self.weights.keys())[:3]}")
        current = {n: p.detach().clone() for n, p in live.items()}
        try:
            for n, p in live.items():
                p.copy_(self.weights[n])
            out, _ = actor.compute_logprobs(batch, trained_only=True)
        finally:
            for n, p in live.items():
                p.copy_(current[n])
        return out
