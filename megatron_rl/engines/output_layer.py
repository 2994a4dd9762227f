"""The embedded engine's output layer: vocabulary logits for 1-3 rows from a transposed copy
of its weight (opt-in: `rollout.fast_output_layer`, `--fast-output-layer`).

Below 4 rows MKL takes a GEMV path for `F.linear(x, W)` on the [vocab, hidden] weight that
can be far slower than its GEMM: for the quickstart's 34,048 x 128 layer on one thread, one
host took 2.6 / 4.3 / 7.0 / 3.0 ms at 1 / 2 / 3 / 4 rows, where `x @ Wt` on a contiguous
[hidden, vocab] copy took 0.5 / 0.9 / 1.3 / 1.8 ms; another took 0.36 / 0.59 / 1.0 ms with
F.linear and 0.24 / 0.52 / 0.79 ms with the copy (`benchmarks/output_layer.py`). From 4 rows
on both run MKL's GEMM, and the copy's gain is the host's: 1.4-1.7x at 4-16 rows on the
first, 0.91-1.05x on the second, where the engine served 16 episodes 0.89-0.95x as fast with
it. So the layer calls F.linear from 4 rows on: its bits on every host, and no choice made by
timing. Below 4 the logits differ from F.linear's by float rounding (as F.linear's own 1-3
rows differ from its 4). The copy costs the layer's bytes once more and is rebuilt after every
weight update.

Why it is not the default: with F.linear, every path to a prompt's logits (a full prefill, a
suffix after a cached prefix, a one-token turn through the decode step) gives the same bits,
so outputs do not depend on what the prefix cache held; through the copy they did by an ulp
(a prompt served before or after others that share its opening: 1 of 6 outputs' log-probs
differed; the cause is not pinned down), so a run resumed after SIGKILL, its cache empty, no
longer repeated an uninterrupted run's step bit for bit.
"""

from __future__ import annotations

import torch

MAX_COPY_BYTES = 512 << 20  # a larger layer keeps F.linear rather than a second copy
COPY_BELOW_ROWS = 4         # MKL's GEMV path: fewer rows than this go through the copy


class TransposedOutputLayer(torch.nn.Module):
    """A bias-free linear layer computing `x @ weight.T`, for fewer than `COPY_BELOW_ROWS`
    rows from a cached contiguous transpose (F.linear otherwise, and whenever it trains).
    It holds the Parameter of the layer it replaces (same name, values and storage, tying
    kept). The copy is rebuilt when the weight is written in place (its version counter moves,
    e.g. `p.add_()` under no_grad), moves (`p.data = ...`), or `refresh()` is called: the
    engine calls it after every load, whose `.data` writes and shared-memory writes move no
    counter."""

    def __init__(self, weight: torch.nn.Parameter):
        super().__init__()
        self.weight = weight
        self.transposed: torch.Tensor | None = None
        self.made_from: tuple[int, int] = (-1, 0)  # (version, data_ptr) of the copied weight

    def refresh(self) -> None:
        self.transposed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.numel() >= COPY_BELOW_ROWS * x.shape[-1]  # rows of any leading shape
                or (torch.is_grad_enabled() and w.requires_grad)):  # training: w's gradient
            return torch.nn.functional.linear(x, w)
        now = (w._version, w.data_ptr())
        if self.transposed is None or now != self.made_from:
            with torch.inference_mode(False):  # a plain tensor, usable outside the engine too
                self.transposed = w.detach().t().contiguous()
            self.made_from = now
        return torch.matmul(x, self.transposed)


def transpose_output_layer(model: torch.nn.Module) -> TransposedOutputLayer | None:
    """Swap the model's `lm_head` (a bias-free nn.Linear) for a `TransposedOutputLayer`;
    returns it, or None where the layer stays (another module, a bias, too large to copy)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, TransposedOutputLayer):  # a second engine on the same model
        return head
    if (type(head) is not torch.nn.Linear or head.bias is not None
            or head.weight.numel() * head.weight.element_size() > MAX_COPY_BYTES):
        return None
    model.lm_head = TransposedOutputLayer(head.weight)
    return model.lm_head
