"""A deterministic, learnable token stream for smoke training and tests.

Each sequence is an arithmetic progression modulo the vocabulary (random start and stride per
sequence). A model that reads two tokens knows the rest, so the loss falls quickly from
ln(vocab) toward zero, which makes "is training working?" visible in a few steps. Sample i is a
pure function of (seed, i), so a data cursor is all a checkpoint needs to resume the stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.records.batch import TokenBatch


@dataclass(frozen=True)
class ArithmeticSequences:
    vocab_size: int
    seq_length: int
    seed: int = 0
    max_stride: int = 3

    def sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, self.vocab_size, (1,), generator=g))
        stride = int(torch.randint(1, self.max_stride + 1, (1,), generator=g))
        return (start + stride * torch.arange(self.seq_length + 1)) % self.vocab_size

    def batch(self, cursor: int, rows: int) -> TokenBatch:
        """Samples [cursor, cursor + rows) as a next-token batch of seq_length targets."""
        tokens = torch.stack([self.sample(cursor + i) for i in range(rows)])
        return TokenBatch.from_sequences(tokens)
