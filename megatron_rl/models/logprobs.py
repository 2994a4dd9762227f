"""Per-token log-probs and entropy from vocab-parallel logits, chunked over the sequence.

The full [tokens, vocab] logits tensor is never materialised: each chunk's logits are computed
from the final hidden states, reduced across the TP ranks' vocab shards, and recomputed in
backward (activation checkpointing), so memory is bounded by one chunk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def _tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


class _AllReduce(torch.autograd.Function):
    """Sum over TP in forward; the gradient of a sum is passed to every addend unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, op, group) -> torch.Tensor:
        x = x.clone()
        torch.distributed.all_reduce(x, op=op, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def _tp_sum(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    return _AllReduce.apply(x, torch.distributed.ReduceOp.SUM, group) if tp > 1 else x


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                            vocab_size: int, group=None, tp: int = 1
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label) and entropy from this rank's vocab shard `logits[..., V/tp]`.

    `vocab_size` is the true vocabulary: padded ids beyond it get no probability.
    """
    logits = logits.float()
    local = logits.shape[-1]
    pad_from = vocab_size - vocab_start
    if pad_from < local:  # padded rows of the last shard
        logits = logits.masked_fill(
            torch.arange(local, device=logits.device) >= pad_from, float("-inf"))
    with torch.no_grad():
        shift = logits.max(dim=-1, keepdim=True).values
        if tp > 1:
            torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = logits - shift
    exp = shifted.exp()
    sum_exp = _tp_sum(exp.sum(-1), group, tp)
    log_z = sum_exp.log()
    # label logit: only the rank that owns the id contributes
    local_ids = labels - vocab_start
    owned = (local_ids >= 0) & (local_ids < local)
    picked = shifted.gather(-1, local_ids.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1)
    label_logit = _tp_sum(torch.where(owned, picked, torch.zeros_like(picked)), group, tp)
    logprob = label_logit - log_z
    # entropy = log Z - E_p[shifted]; padded ids have p = 0 (guard 0 * -inf)
    p_shifted = torch.where(exp > 0, exp * shifted, torch.zeros_like(exp)).sum(-1)
    entropy = log_z - _tp_sum(p_shifted, group, tp) / sum_exp
    return logprob, entropy


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                     vocab_size: int, sequence_parallel: bool, temperature: float = 1.0,
                     chunk_tokens: int = 4096, keep: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of `labels` [b, s] from final hidden states [s(/tp), b, h].

    `weight` is this rank's output-layer shard [V/tp, h]. Returns two [b, s] float32 tensors.
    `keep` [b, s] (bool): only those positions go through the output layer (the others are 0):
    the vocabulary matmul is most of a small model's cost, and only trained targets need it.
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
    labels_sb = labels.transpose(0, 1)  # [s, b] to match hidden
    if keep is not None:
        where = keep.transpose(0, 1).reshape(-1).nonzero().squeeze(1)
        if where.numel() == 0:  # nothing trained here: zeros, still part of the graph
            zeros = hidden[..., 0].transpose(0, 1).float() * 0.0
            return zeros, zeros
        flat = hidden.reshape(-1, 1, hidden.shape[-1]).index_select(0, where)
        lp, ent = _chunks(flat, weight, labels_sb.reshape(-1, 1).index_select(0, where),
                          vocab_start, vocab_size, group, tp, temperature, chunk_tokens)
        out = [torch.zeros(labels_sb.numel(), dtype=x.dtype, device=x.device)
               .index_put((where,), x.squeeze(1)).view_as(labels_sb).transpose(0, 1)
               for x in (lp, ent)]
        return out[0], out[1]
    lp, ent = _chunks(hidden, weight, labels_sb, vocab_start, vocab_size, group, tp,
                      temperature, chunk_tokens)
    return lp.transpose(0, 1), ent.transpose(0, 1)


def _chunks(hidden: torch.Tensor, weight: torch.Tensor, labels_sb: torch.Tensor,
            vocab_start: int, vocab_size: int, group: Any, tp: int, temperature: float,
            chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[s, b] log-probs and entropies, `chunk_tokens` positions through the output layer at a
    time (recomputed in backward: the [chunk, V] logits are never all kept)."""
    seq, batch = labels_sb.shape
    step = max(1, chunk_tokens // max(batch, 1))

    def one_chunk(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
        logits = torch.nn.functional.linear(h, w)
        if temperature != 1.0:
            logits = logits / temperature
        return vocab_parallel_logprobs(logits, y, vocab_start, vocab_size, group, tp)

    logps, ents = [], []
    for s0 in range(0, seq, step):
        h, y = hidden[s0:s0 + step], labels_sb[s0:s0 + step]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            lp, ent = checkpoint(one_chunk, h, weight, y, use_reentrant=False)
        else:
            lp, ent = one_chunk(h, weight, y)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)
