"""The embedded engine's output layer: vocabulary logits from a transposed copy of its weight
(opt-in: `rollout.fast_output_layer`, `--fast-output-layer`).

`F.linear(x, W)` on the [vocab, hidden] weight makes MKL pack the whole matrix for every call
(`sgemm_scopy_right16`), and below 4 rows it takes a GEMV path that is slower still: for the
quickstart's 34,048 x 128 layer on one thread, 2.6 / 4.3 / 7.0 / 3.0 / 4.1 ms at 1 / 2 / 3 / 4 /
16 rows, where `x @ Wt` on a contiguous [hidden, vocab] copy took 0.5 / 0.9 / 1.3 / 1.8 / 3.0 ms
(`benchmarks/output_layer.py`). From 4 rows on both run the same GEMM kernel and give the same
logits bit for bit, which a probe checks before the swap; below 4 they differ by float rounding
(as F.linear's own 1-3 rows differ from its 4). The copy costs the layer's bytes once more and
is rebuilt after every weight update.

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
PROBE_ROWS = (4, 7, 16)     # where the swapped layer must match F.linear bit for bit


class TransposedOutputLayer(torch.nn.Module):
    """A bias-free linear layer computing `x @ weight.T` from a cached contiguous transpose.
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
        if torch.is_grad_enabled() and w.requires_grad:  # training: the weight's gradient
            return torch.nn.functional.linear(x, w)
        now = (w._version, w.data_ptr())
        if self.transposed is None or now != self.made_from:
            with torch.inference_mode(False):  # a plain tensor, usable outside the engine too
                self.transposed = w.detach().t().contiguous()
            self.made_from = now
        return torch.matmul(x, self.transposed)


def transpose_output_layer(model: torch.nn.Module, threads: int | None = None
                           ) -> TransposedOutputLayer | None:
    """Swap the model's `lm_head` (a bias-free nn.Linear) for a `TransposedOutputLayer` where
    the probe finds its logits bit for bit F.linear's at `PROBE_ROWS` rows on `threads`
    intra-op threads (the engine's: MKL splits the work, and so rounds, by thread count);
    returns it, or None where the layer stays (another module, a bias, too large to copy, or
    other logits)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, TransposedOutputLayer):  # a second engine on the same model
        return head
    if (type(head) is not torch.nn.Linear or head.bias is not None
            or head.weight.numel() * head.weight.element_size() > MAX_COPY_BYTES):
        return None
    swapped = TransposedOutputLayer(head.weight)
    gen, prior = torch.Generator().manual_seed(0), torch.get_num_threads()
    torch.set_num_threads(threads or prior)
    try:
        with torch.no_grad():
            for rows in PROBE_ROWS:
                x = torch.randn(rows, head.in_features, generator=gen).to(head.weight.dtype)
                if not torch.equal(swapped(x), torch.nn.functional.linear(x, head.weight)):
                    return None
    finally:
        torch.set_num_threads(prior)
    swapped.refresh()
    model.lm_head = swapped
    return swapped
