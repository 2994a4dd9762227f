"""The embedded engine's decode step without the model's forward wrappers.

A tiny model's decode step is mostly per-op overhead: the forward's wrappers (output capture,
config defaults, mask building, output records), for Qwen3.5's Gated DeltaNet layers
transformers' reference kernels, written for whole sequences (transposes and fp32 copies of
every input, a depthwise convolution through oneDNN for four products a channel), and the MoE
blocks' module wrappers and bookkeeping ops. The step here runs the model's own modules in
order and, for those layers and blocks, the same arithmetic in fewer ops. It is used only
where a probe finds its logits bit for bit the model's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# what `gated_delta_decode` reads of a Gated DeltaNet module (transformers' Qwen3.5 layout)
GATED_DELTA_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log",
                     "dt_bias", "norm", "out_proj")


def pad_bias(pad: torch.Tensor, cols: int, dtype: torch.dtype, skip: int = 0,
             front: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, 1, 1, skip + cols] additive attention mask: the dtype's minimum on each row's
    `pad` columns after the first `skip` (and on its first `front` columns of those), 0
    elsewhere. Not -inf: a query row that sees only padding must still give finite values (a
    left-padded prefill's pad rows), or NaNs reach the cache."""
    col = torch.arange(cols)[None] < pad[:, None]
    head = (torch.zeros(len(pad), skip, dtype=torch.bool) if front is None
            else torch.arange(skip)[None] < front[:, None])
    cut = torch.cat([head, col], 1)[:, None, None, :]
    return torch.zeros(cut.shape, dtype=dtype).masked_fill_(cut, torch.finfo(dtype).min)


def lean_decode(model: torch.nn.Module, attention: str = "bias"
                ) -> Callable[..., torch.Tensor] | None:
    """A decode step (one new token per row): embedding, rotary tables, each decoder layer,
    final norm, output layer; returns the [rows, vocab] logits. In the "mask4d" mode (hybrids)
    it takes the engine's prepared 4D mask for the full-attention layers and none for the
    recurrent ones (a decode token is never padding), as the model's forward hands them out;
    their Gated DeltaNet layers run `gated_delta_decode`. The full-attention layers take that
    mask as an additive `position_bias` where the probe allows (`as_bias`): sdpa then runs its
    grouped-query kernel, where a mask makes transformers copy the cache's KV heads up to the
    query heads at every step (0.83x the time of 64 tokens after 1.5-3k-token prompts on the
    tiny hybrid, prefill included). None unless the model has that
    plain decoder layout and the probe finds its logits bit for bit the model's own, padded
    rows included (the first variant that does is kept)."""
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if (attention not in ("bias", "mask4d") or inner is None
            or not all(hasattr(inner, p) for p in parts) or not hasattr(model, "lm_head")):
        return None
    n = model.config.num_hidden_layers
    layers = list(inner.layers[:n])
    kinds = list(getattr(model.config, "layer_types", None) or ["full_attention"] * n)[:n]
    recurrent = [kind == "linear_attention" for kind in kinds]
    lean_layers = [r and _gated_delta_layer(layer) for r, layer in zip(recurrent, layers,
                                                                        strict=True)]
    # the Gated DeltaNet kernel where the layers allow it, else every layer as it is; the
    # rotary tables' positions: [rows, 1], or (Qwen3.5's multimodal RoPE) the text positions
    # once per section, as its forward expands them
    cases = _probe_cases(model)
    lean_moe = [_sparse_moe(layer) for layer in layers]
    for own in ([lean_layers, None] if any(lean_layers) else [None]):
        for moe in ([lean_moe, None] if any(lean_moe) else [None]):
            for sections in (None, 3):
                for as_bias in ([True, False] if attention == "mask4d" else [False]):
                    step = _step(model, layers, recurrent, own, sections, as_bias, moe)
                    if cases and _decodes_exactly(model, step, attention, cases):
                        return step
    return None


def _step(model: torch.nn.Module, layers: list[torch.nn.Module], recurrent: list[bool],
          lean_layers: list[bool] | None, sections: int | None, as_bias: bool = False,
          lean_moe: list[bool] | None = None) -> Callable[..., torch.Tensor]:
    inner = model.model
    mlps = [functools.partial(sparse_moe_decode, layer.mlp) if lean_moe and lean_moe[i]
            else layer.mlp for i, layer in enumerate(layers)]

    def step(ids: torch.Tensor, pos: torch.Tensor, cache: Any,
             attention_mask: torch.Tensor | None = None, **extra: Any) -> torch.Tensor:
        h = inner.embed_tokens(ids)
        rope = inner.rotary_emb(h, position_ids=pos if sections is None
                                else pos[None].expand(sections, *pos.shape))
        for i, (layer, linear) in enumerate(zip(layers, recurrent, strict=True)):
            if lean_layers is not None and lean_layers[i]:
                h = gated_delta_layer(layer, h, cache.layers[i], mlps[i])
                continue
            # a recurrent layer gets no padding (a decode token is never padding); an
            # attention layer the mask, or the same values as sdpa's bias (`as_bias`)
            padding = ({"attention_mask": None} if linear else
                       {"attention_mask": None, "position_bias": attention_mask} if as_bias
                       else {"attention_mask": attention_mask})
            args = {"position_ids": pos, "past_key_values": cache, "use_cache": True,
                    "position_embeddings": rope, **padding, **extra}
            h = (attention_layer(layer, h, mlps[i], **args) if lean_moe and lean_moe[i]
                 and not linear else layer(h, **args))
        return model.lm_head(inner.norm(h)[:, -1, :])

    step.gated_delta_layers = sum(lean_layers or ())  # type: ignore[attr-defined]
    step.as_bias = as_bias  # type: ignore[attr-defined]
    step.moe_blocks = sum(lean_moe or ())  # type: ignore[attr-defined]
    return step


def _gated_delta_layer(layer: torch.nn.Module) -> bool:
    """A pre-norm decoder layer around a Gated DeltaNet module of the layout read here."""
    attn = getattr(layer, "linear_attn", None)
    return (attn is not None and all(hasattr(attn, p) for p in GATED_DELTA_PARTS)
            and all(hasattr(layer, p) for p in ("input_layernorm", "post_attention_layernorm",
                                                "mlp")))


def gated_delta_layer(layer: torch.nn.Module, h: torch.Tensor, states: Any,
                      mlp: Callable[[torch.Tensor], Any]) -> torch.Tensor:
    """One decode step of a Gated DeltaNet decoder layer: token mixer, then the MLP (or MoE)
    run by `mlp` (the layer's own, or `sparse_moe_decode` on it), each around its residual."""
    h = h + gated_delta_decode(layer.linear_attn, layer.input_layernorm(h), states)
    return _with_mlp(layer, h, mlp)


def attention_layer(layer: torch.nn.Module, h: torch.Tensor, mlp: Callable[[torch.Tensor], Any],
                    **attention: Any) -> torch.Tensor:
    """One decode step of a pre-norm attention decoder layer, its MLP run by `mlp`: the
    layer's forward, line for line (the probe holds it to the layer's bits)."""
    out = layer.self_attn(hidden_states=layer.input_layernorm(h), **attention)
    return _with_mlp(layer, h + (out[0] if isinstance(out, tuple) else out), mlp)


def _with_mlp(layer: torch.nn.Module, h: torch.Tensor, mlp: Callable[[torch.Tensor], Any]
              ) -> torch.Tensor:
    """The layer's post-attention norm, `mlp` (a MoE block answers a tuple), its residual."""
    out = mlp(layer.post_attention_layernorm(h))
    return h + (out[0] if isinstance(out, tuple) else out)


def _sparse_moe(layer: torch.nn.Module) -> bool:
    """A pre-norm decoder layer whose MLP is a sparse MoE block of the layout
    `sparse_moe_decode` reads (transformers' Qwen3-MoE / Qwen3.5 blocks: a router module,
    3D expert weights with gate and up concatenated, no biases; Qwen3.5's gated shared
    expert), where torch has `grouped_mm`."""
    mlp = getattr(layer, "mlp", None)
    experts, shared = getattr(mlp, "experts", None), getattr(mlp, "shared_expert", None)
    if (not hasattr(torch.nn.functional, "grouped_mm") or not hasattr(mlp, "gate")
            or not all(hasattr(layer, p) for p in ("input_layernorm", "post_attention_layernorm"))
            or not all(hasattr(experts, p) for p in ("act_fn", "num_experts"))):
        return False
    weights = [getattr(experts, p, None) for p in ("gate_up_proj", "down_proj")]
    return (all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights)
            and not getattr(experts, "has_bias", False)
            and not getattr(experts, "is_transposed", False)
            and (shared is None or (hasattr(mlp, "shared_expert_gate") and all(
                hasattr(shared, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")))))


def sparse_moe_decode(block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A sparse MoE block on a decode step's rows, h [rows, 1, hidden]: the model's router,
    then the arithmetic of transformers' grouped-mm experts (the same sort, the same two
    grouped GEMMs, the same sum over each token's experts) in fewer ops (counts by bincount,
    the inverse permutation as one scatter) and without the modules' call wrappers; a shared
    expert and its sigmoid gate as Qwen3.5's block adds them. ~0.7x the block's time at 16
    rows."""
    x = h.view(-1, h.shape[-1])
    _, weights, chosen = block.gate(x)
    experts, k = block.experts, chosen.shape[-1]
    ids, perm = torch.sort(chosen.reshape(-1))
    offsets = torch.cumsum(torch.bincount(ids, minlength=experts.num_experts), 0,
                           dtype=torch.int32)
    grouped_mm = torch.nn.functional.grouped_mm
    gate, up = grouped_mm(x[perm // k], experts.gate_up_proj.transpose(-2, -1),
                          offs=offsets).chunk(2, dim=-1)
    down = grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(-2, -1),
                      offs=offsets)
    out = torch.empty_like(down)
    out[perm] = down * weights.reshape(-1)[perm].unsqueeze(-1)
    out = out.view(-1, k, x.shape[-1]).sum(dim=1)
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        linear = torch.nn.functional.linear
        s = linear(shared.act_fn(linear(x, shared.gate_proj.weight))
                   * linear(x, shared.up_proj.weight), shared.down_proj.weight)
        out = out + torch.sigmoid(linear(x, block.shared_expert_gate.weight)) * s
    return out.view(h.shape)


def gated_delta_decode(attn: torch.nn.Module, x: torch.Tensor, states: Any) -> torch.Tensor:
    """Gated DeltaNet on one new token per row, x [rows, 1, hidden]: the causal convolution's
    window shifts by one and its output is the window's products summed in kernel order (one
    multiply-add per tap, as oneDNN's depthwise convolution accumulates), then the gated delta
    rule's single step on the [rows, heads, dk, dv] state. Both states are written in place
    (`states.conv_states[0]`, `states.recurrent_states[0]`), as transformers' kernels do."""
    rows = x.shape[0]
    qkv = attn.in_proj_qkv(x)[:, 0]                           # [rows, channels]
    z = attn.in_proj_z(x)
    beta = attn.in_proj_b(x)[:, 0].sigmoid()                  # [rows, v heads]
    g = (-attn.A_log.float().exp() * torch.nn.functional.softplus(
        attn.in_proj_a(x).float() + attn.dt_bias))[:, 0]
    conv, w = states.conv_states[0], attn.conv1d.weight[:, 0]  # [rows, channels, taps]
    conv.copy_(torch.cat([conv[:, :, 1:], qkv[:, :, None].to(conv.dtype)], -1))
    mixed = conv[:, :, 0] * w[:, 0]
    for k in range(1, w.shape[1]):
        mixed = torch.addcmul(mixed, conv[:, :, k], w[:, k])
    if attn.conv1d.bias is not None:
        mixed = mixed + attn.conv1d.bias
    # transformers activates the last of two convolution outputs, a view of stride 2, which
    # takes torch's scalar loop: a contiguous tensor takes the vectorised one, whose exp
    # differs in the last bit now and then
    strided = mixed.new_empty(rows, mixed.shape[1], 2)[:, :, 1]
    mixed = _activation(attn.activation)(strided.copy_(mixed)).to(x.dtype)
    kd, dk, dv = attn.key_dim, attn.head_k_dim, attn.head_v_dim
    q = mixed[:, :kd].reshape(rows, -1, dk).float()
    k = mixed[:, kd:2 * kd].reshape(rows, -1, dk).float()
    v = mixed[:, 2 * kd:].reshape(rows, -1, dv).float()
    if attn.num_v_heads > attn.num_k_heads:
        q = q.repeat_interleave(attn.num_v_heads // attn.num_k_heads, dim=1)
        k = k.repeat_interleave(attn.num_v_heads // attn.num_k_heads, dim=1)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / (dk ** 0.5)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    state = states.recurrent_states[0]
    s = state.float() * g.exp()[..., None, None]
    delta = (v - (s * k[..., None]).sum(-2)) * beta.float()[..., None]
    s = s + k[..., None] * delta[..., None, :]
    core = (s * q[..., None]).sum(-2).to(x.dtype)              # [rows, v heads, dv]
    state.copy_(s)
    core = attn.norm(core.reshape(-1, dv), z.reshape(-1, dv))
    return attn.out_proj(core.reshape(rows, 1, -1))


@functools.cache  # looked up per layer and decode step
def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _probe_cases(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, Any]]:
    """Two rows of 5 tokens prefilled by the model, the first left-padded by 0 or by 2 (one
    case each), with the two tokens each row decodes next: (pad, next ids, cache). Built once
    for every variant the probe tries; empty where the model's forward takes no such call."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (2, 5), generator=gen)
    nxt = torch.randint(0, vocab, (2, 2), generator=gen)
    cases = []
    try:
        with torch.no_grad():
            for pad in (torch.tensor([0, 0]), torch.tensor([2, 0])):
                mask2d = (torch.arange(5)[None] >= pad[:, None]).long()
                cache = model(input_ids=ids, attention_mask=mask2d, use_cache=True,
                              past_key_values=DynamicCache(config=model.config)
                              ).past_key_values
                cases.append((pad, nxt, cache))
    except Exception:  # another forward signature: the model's own forward
        return []
    return cases


def _decodes_exactly(model: torch.nn.Module, step: Callable[..., torch.Tensor],
                     attention: str, cases: list[tuple[torch.Tensor, torch.Tensor, Any]]
                     ) -> bool:
    """Two decode steps both ways from copies of each case's cache, the padding passed as the
    engine passes it: the step's logits bit for bit the model's."""
    import copy

    dtype = next(model.parameters()).dtype
    try:
        with torch.no_grad():
            for pad, nxt, cache in cases:
                theirs, ours = copy.deepcopy(cache), copy.deepcopy(cache)
                for t in range(2):  # the second step reads the states the first one wrote
                    pos = (5 + t - pad)[:, None]
                    bias = pad_bias(pad, 6 + t, dtype) if pad.any() else None
                    extra = ({"attention_mask": bias} if attention == "mask4d" else
                             {"position_bias": bias} if bias is not None else {})
                    want = model(input_ids=nxt[:, t:t + 1], position_ids=pos, use_cache=True,
                                 past_key_values=theirs, **extra).logits[:, -1, :]
                    if not torch.equal(want, step(nxt[:, t:t + 1], pos, ours, **extra)):
                        return False
        return True
    except Exception:  # another layer signature: the model's own forward
        return False
