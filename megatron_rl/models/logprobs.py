"""Per-token log-probs and entropy from vocab-parallel logits, chunked over the tokens.

The full [tokens, vocab] logits tensor is never materialised: one fused autograd function per
chunk computes that chunk's logits from the final hidden states, reduces the softmax statistics
across the TP ranks' vocab shards, and keeps only per-token numbers. Forward leaves
e = exp(z - max) in the logits' place; a chunk whose logits take at most
`memory_plan.KEEP_LOGITS_BYTES` of its device keeps it for backward, a larger one is
recomputed there (matmul, subtract, exp: the same values). Backward turns e into the gradient
in place, p = e / sum e being one pass. Between the matmuls, the elementwise work runs over
blocks of rows that fit in cache. (Autograd through the elementwise ops, or activation
checkpointing, made ~10 full-size passes per chunk and allocated a zero tensor per gather: 5x
a plain cross-entropy step on CPU.)
"""

from __future__ import annotations

import itertools

import torch

from megatron_rl.models import memory_plan

MAX, SUM = torch.distributed.ReduceOp.MAX, torch.distributed.ReduceOp.SUM
# the softmax's elementwise passes go over this many bytes of logits at a time: each block
# stays in cache through all of them, where passes over a whole chunk each went to memory
# (bit for bit the same values: every row's sums run in the same kernel). Each block's ops
# also cost a fixed overhead (dispatch, the intra-op threads' fork and join). At
# the quickstart's 34k ids: on a CPU with 2 MB of L2 a step took 1.08 s with 2 MB blocks,
# 1.12 s with 8 MB, 1.15 s with 512 KB; on an EPYC with 512 KB of L2 and 32 MB of L3 4 MB
# blocks ran the step 1.8 % faster than 2 MB and 1 MB 6.5 % slower (same process, 24 rounds)
BLOCK_BYTES = 4 << 20


def _row_cuts(n: int, columns: int) -> list[int]:
    """Where n rows split into blocks of at least 2 rows (a lone row's sums take another
    kernel: other roundings), for `tensor_split`."""
    rows = max(2, BLOCK_BYTES // max(4 * columns, 1))
    cuts = list(range(rows, n, rows))
    if cuts and n - cuts[-1] < 2:
        cuts.pop()
    return cuts


def _widest(n: int, cuts: list[int]) -> int:
    """Rows in the largest block of n rows cut at `cuts`."""
    edges = [0, *cuts, n]
    return max(b - a for a, b in itertools.pairwise(edges))


def _label_cuts(at: torch.Tensor, cuts: list[int]) -> list[int]:
    """Where the sorted row indices `at` split to follow the row blocks `cuts`."""
    return torch.searchsorted(at, torch.tensor(cuts, dtype=at.dtype)).tolist()


def _tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def _all_reduce(x: torch.Tensor, op, group, tp: int) -> torch.Tensor:
    if tp > 1:
        torch.distributed.all_reduce(x, op=op, group=group)
    return x


def _mm_in(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


def _logits(h: torch.Tensor, w: torch.Tensor, temperature: float,
            dtype: torch.dtype | None) -> torch.Tensor:
    z = torch.nn.functional.linear(_mm_in(h, dtype), _mm_in(w, dtype)).float()
    return z.div_(temperature) if temperature != 1.0 else z


class _LinearLogprobs(torch.autograd.Function):
    """(log p(label), entropy) [n] of softmax(h @ w[:valid].T / temperature) over all TP ranks'
    shards. `w` is this rank's shard [V/tp, d]; its rows from `valid` on are vocabulary
    padding (no probability, zero gradient). Labels outside the shard contribute nothing here.
    `mm_dtype`: the three matmuls' inputs in that dtype (the softmax stays fp32)."""

    @staticmethod
    def forward(ctx, h, w, labels, vocab_start: int, valid: int, temperature: float,
                group, tp: int, mm_dtype: torch.dtype | None = None):
        wv = w[:valid]
        z = _logits(h, wv, temperature, mm_dtype)             # [n, valid]
        n = h.shape[0]
        local = labels - vocab_start
        owned = (local >= 0) & (local < valid)
        if not valid:
            shift, zero = z.new_full((n,), float("-inf")), z.new_zeros(n)
            _all_reduce(shift, MAX, group, tp)
            stats = torch.stack([zero, zero, zero])
        else:
            # the max over every shard first when there are several; alone, block by block
            shift = z.amax(-1) if tp > 1 else z.new_empty(n)
            _all_reduce(shift, MAX, group, tp)
            label_z = z.gather(-1, local.clamp(0, valid - 1)[:, None])[:, 0]
            stats = z.new_empty(3, n)                        # sum e, label z, sum e * z
            cuts = _row_cuts(n, valid)
            scratch = z.new_empty(_widest(n, cuts), valid)
            # views made once per chunk: a block then costs five kernels and no indexing.
            # e = exp(z - shift) replaces the logits in place: backward's p is e / sum e, one
            # pass (recomputing exp there took 3x as long at 34k ids)
            for zb, sb, sum_e, e_z in zip(*(x.tensor_split(cuts) for x in (
                    z, shift[:, None], stats[0], stats[2])), strict=True):
                if tp == 1:
                    torch.amax(zb, -1, keepdim=True, out=sb)
                zs = torch.sub(zb, sb, out=scratch[:zb.shape[0]])
                torch.exp(zs, out=zb)
                torch.sum(zb, -1, out=sum_e)
                torch.sum(zs.mul_(zb), -1, out=e_z)
            stats[1] = torch.where(owned, label_z - shift, 0.0)
        _all_reduce(stats, SUM, group, tp)
        sum_e, label_z, e_z = stats
        log_z = sum_e.log()
        logp = label_z - log_z
        mean_z = e_z / sum_e                                  # E_p[z - shift]
        ent = log_z - mean_z
        # small chunks keep e for backward (what recomputing it saves is not worth a matmul)
        kept = z if z.numel() * z.element_size() <= memory_plan.keep_logits_bytes(
            z.device.type) else None
        ctx.save_for_backward(h, w, labels, shift, sum_e, mean_z, kept)
        ctx.meta = (vocab_start, valid, temperature, mm_dtype)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, w, labels, shift, sum_e, mean_z, kept = ctx.saved_tensors
        vocab_start, valid, temperature, mm_dtype = ctx.meta
        n = h.shape[0]
        g_logp = g_logp if g_logp is not None else h.new_zeros(n, dtype=torch.float32)
        wv = w[:valid]
        # kept or recomputed, e = exp(z - shift) (the same values either way) becomes the
        # gradient in place: a second pass writing a new [n, V] tensor cost 2 % more at 34k
        # ids. So this graph takes one backward (a second fails autograd's in-place check)
        grad = _logits(h, wv, temperature, mm_dtype) if kept is None else kept
        with_ent = g_ent is not None and bool(g_ent.any())
        local = labels - vocab_start
        owned = (local >= 0) & (local < valid)
        # d logp / dz = onehot - p;  d entropy / dz = -p (z - E_p[z]), p = e / sum e. With
        # z - shift = log e: grad = e (scale - log e g_ent / sum e), scale = (E_p[z - shift]
        # g_ent - g_logp) / sum e; the log only when the entropy has a gradient
        at = owned.nonzero()[:, 0]
        cols, g_at = local[at], g_logp[at]
        cuts = _row_cuts(n, valid)
        scale = ((mean_z * g_ent if with_ent else 0.0) - g_logp) / sum_e
        per_row = (shift, scale, *((-g_ent / sum_e,) if with_ent else ()))
        blocks = zip(*(x.tensor_split(cuts) for x in (grad, *(r[:, None] for r in per_row))),
                     *(x.tensor_split(_label_cuts(at, cuts)) for x in (at, cols, g_at)),
                     strict=True)
        scratch = grad.new_empty(_widest(n, cuts), valid) if with_ent else None
        tiny = torch.finfo(grad.dtype).tiny
        for zb, sb, scale_b, *ent, at_b, cols_b, g_b in blocks:  # zb: e, then the gradient
            if kept is None:
                torch.sub(zb, sb, out=zb).exp_()
            if ent:  # log e from the smallest normal up: 0 where e is 0 (xlogy took 3x)
                log_e = torch.clamp_min(zb, tiny, out=scratch[:zb.shape[0]]).log_()
                zb.mul_(torch.addcmul(scale_b, log_e, ent[0], out=log_e))
            else:
                zb.mul_(scale_b)
            grad.index_put_((at_b, cols_b), g_b, accumulate=True)
            if temperature != 1.0:
                zb.div_(temperature)
        grad = _mm_in(grad, mm_dtype or h.dtype)
        grad_h = (grad @ _mm_in(wv, mm_dtype)).to(h.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad.t() @ _mm_in(h, mm_dtype)).to(w.dtype)
            if valid < w.shape[0]:
                grad_w = torch.cat([grad_w, grad_w.new_zeros(w.shape[0] - valid, w.shape[1])])
        return grad_h, grad_w, None, None, None, None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                     vocab_size: int, sequence_parallel: bool, temperature: float = 1.0,
                     chunk_tokens: int = 4096, keep: torch.Tensor | None = None,
                     matmul_dtype: torch.dtype | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of `labels` [b, s] from final hidden states [s(/tp), b, h].

    `weight` is this rank's output-layer shard [V/tp, h]; `vocab_size` is the true vocabulary
    (padded ids beyond it get no probability). Returns two [b, s] float32 tensors.
    `keep` [b, s] (bool): only those positions go through the output layer (the others are 0):
    the vocabulary matmul is most of a small model's cost, and only trained targets need it.
    `matmul_dtype` (e.g. bf16 for an fp32 model): the output layer's matmuls run on inputs
    cast to it, the softmax statistics stay fp32. On a CPU with AVX512-BF16 (and no AMX) those
    matmuls ran 3-4x faster than in fp32; logits then carry bf16's ~3 significant digits.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import mappings

    tp = ps.get_tensor_model_parallel_world_size()
    group = _tp_group() if tp > 1 else None
    # Make the input whole and replicated on every TP rank; the mapping's backward sums the
    # partial gradients of the vocab shards (reduce-scatter for SP, all-reduce otherwise).
    if sequence_parallel and tp > 1:
        hidden = mappings.gather_from_sequence_parallel_region(hidden, group=group)
    elif tp > 1:
        hidden = mappings.copy_to_tensor_model_parallel_region(hidden, group=group)
    vocab_start = ps.get_tensor_model_parallel_rank() * weight.shape[0]
    valid = max(0, min(weight.shape[0], vocab_size - vocab_start))
    labels_sb = labels.transpose(0, 1)  # [s, b] to match hidden
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = labels_sb.reshape(-1)
    where = None
    if keep is not None:
        where = keep.transpose(0, 1).reshape(-1).nonzero().squeeze(1)
        if where.numel() == 0:  # nothing trained here: zeros, still part of the graph
            zeros = hidden[..., 0].transpose(0, 1).float() * 0.0
            return zeros, zeros
        if where.numel() == flat_y.numel():  # every position: no copies in and out
            where = None
        else:
            flat_h, flat_y = flat_h.index_select(0, where), flat_y.index_select(0, where)
    parts = [_LinearLogprobs.apply(h, weight, y, vocab_start, valid, temperature, group, tp,
                                   matmul_dtype)
             for h, y in zip(torch.split(flat_h, chunk_tokens),
                             torch.split(flat_y, chunk_tokens), strict=True)]
    out = []
    for x in ([p[i] for p in parts] for i in (0, 1)):
        x = x[0] if len(x) == 1 else torch.cat(x)
        if where is not None:
            x = x.new_zeros(labels_sb.numel()).index_put((where,), x)
        out.append(x.view_as(labels_sb).transpose(0, 1))
    return out[0], out[1]
