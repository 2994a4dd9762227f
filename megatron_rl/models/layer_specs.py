"""Decoder block specs: which attention / MLP / norm modules each layer is built from.

On GPU (Transformer Engine) megatron-core's own spec functions are used unchanged. Without TE
the block is composed here from megatron's local modules, for every registry architecture:

* one `RMSNorm` module for every norm (input, pre-MLP, q/k, GDN output, final), honouring the
  config's zero-centred (1+w) gamma that Qwen3.5 uses, which megatron's torch norm lacks;
* Qwen3.5's hybrid pattern: Gated DeltaNet layers with an unfused input norm (TE fuses it into
  `in_proj`), gated full attention every `full_attention_interval` layers;
* checkpoint keys remapped to the TE spec's names, so a checkpoint written on CPU loads on a
  TE cluster and vice versa (megatron's local spec also renames the MoE pre-MLP norm, which
  the TE MoE spec does not; that is not copied here).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_rl.models.registry import ModelSpec


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in fp32 like HF Qwen3/Qwen3.5; gamma is (1 + w) when the config asks
    for zero-centred gamma. The weight is marked sequence-parallel as TENorm marks it, so its
    gradient is all-reduced over TP under sequence parallelism."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6,
                 zero_centered: bool | None = None, **_unused: Any):
        super().__init__()
        self.zero_centered = bool(config.layernorm_zero_centered_gamma if zero_centered is None
                                  else zero_centered)
        self.eps = eps
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = self.weight.float() + 1.0 if self.zero_centered else self.weight.float()
        return _RMSNorm.apply(x.float(), gamma, self.eps).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    """`F.rms_norm(x, gamma.shape, gamma, eps)` over the last dim, forward and backward the same
    values bit for bit, in one autograd node. On CPU torch runs rms_norm as six ops that
    autograd differentiates one by one (a pow and a mean backward over [tokens, hidden], a
    copy for x ** 1): forward and backward took 1.4-1.8x as long at the test models' widths."""

    @staticmethod
    def forward(ctx, x, gamma, eps: float):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        normed = x * rstd
        ctx.save_for_backward(x, rstd, normed, gamma)
        return normed * gamma

    @staticmethod
    def backward(ctx, g):
        # autograd's chain, op for op where it rounds: d rsqrt(v) = -0.5 g rsqrt(v)^3;
        # d mean = g / hidden; d x^2 = 2 x g (the scalings by 2 and -0.5 are exact)
        x, rstd, normed, gamma = ctx.saved_tensors
        g_gamma = ((g * normed).sum(dim=tuple(range(g.dim() - 1)))
                   if ctx.needs_input_grad[1] else None)
        g_normed = g * gamma
        g_rstd = (g_normed * x).sum(-1, keepdim=True)
        g_square = (-0.5 * g_rstd) * rstd.pow(3) / x.shape[-1] * 2
        g_x = g_normed * rstd
        g_x += x * g_square
        return g_x, g_gamma, None


class PlainTENorm:
    """TENorm without zero-centred gamma, whatever the config says (see `_plain_gdn_out_norm`)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5):
        import copy

        from megatron.core.extensions.transformer_engine import TENorm

        plain = copy.copy(config)
        plain.layernorm_zero_centered_gamma = False
        return TENorm(plain, hidden_size, eps)


@functools.cache
def torch_sdpa_attention() -> type:
    """Megatron's local `DotProductAttention` computed by torch's fused
    `scaled_dot_product_attention` (the flash kernel on CPU). The unfused path materialises the
    [b*np, sq, sk] scores, their softmax and its backward: the largest share of a tiny model's
    CPU step. Same math (causal or a bool mask, GQA); what SDPA cannot express here (softmax
    offsets, sliding windows, query-key layer scaling, attention dropout while training, a
    query shorter than its keys) runs megatron's own forward."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class TorchSDPAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            if (packed_seq_params is not None or attention_bias is not None
                    or self.softmax_offset is not None
                    or self.config.apply_query_key_layer_scaling
                    or self.scale_mask_softmax.window_size is not None
                    or (self.training and self.attention_dropout.p > 0)
                    or query.shape[0] != key.shape[0]):
                dense = getattr(attention_mask, "dense", None)  # a packed micro-batch's
                return super().forward(query, key, value,
                                       attention_mask if dense is None else dense(),
                                       attn_mask_type, attention_bias, packed_seq_params)
            # [b, heads, s, d]; contiguous: the flash kernel reads [s, b]-strided rows slower
            # (forward and backward) than one copy costs
            q, k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (query, key, value))
            spans = getattr(attention_mask, "packed_spans", None)
            if spans is not None:
                out = self._per_sequence(q, k, v, spans)
            else:
                allowed = None if attention_mask is None else ~attention_mask  # True = masked
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=allowed, scale=self.softmax_scale,
                    is_causal=allowed is None and self.attn_mask_type == AttnMaskType.causal,
                    enable_gqa=k.shape[1] != q.shape[1])
            return out.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0],
                                                   self.hidden_size_per_partition)

        def _per_sequence(self, q, k, v, spans: list[list[tuple[int, int, int, int]]]):
            """Causal attention within each packed sequence alone, after the whole shared
            prefix it extends, if any: what the mask computes, without the row-wide scores (a
            row of n sequences costs ~1/n). Padding columns get zeros."""
            gqa = k.shape[1] != q.shape[1]
            sdpa = torch.nn.functional.scaled_dot_product_attention
            rows = []
            for b, row in enumerate(spans):
                parts, end = [], 0
                for start, stop, t0, t1 in row:
                    if start > end:
                        parts.append(v.new_zeros(1, q.shape[1], start - end, v.shape[3]))
                    keys, values = k[b:b + 1, :, start:stop], v[b:b + 1, :, start:stop]
                    if t1 == t0:
                        parts.append(sdpa(q[b:b + 1, :, start:stop], keys, values,
                                          scale=self.softmax_scale, is_causal=True,
                                          enable_gqa=gqa))
                    else:  # every prefix column, then causal within the sequence
                        n = stop - start
                        allowed = torch.ones(n, t1 - t0 + n, dtype=torch.bool,
                                             device=q.device)
                        allowed[:, t1 - t0:] = allowed[:, t1 - t0:].tril()
                        parts.append(sdpa(
                            q[b:b + 1, :, start:stop],
                            torch.cat([k[b:b + 1, :, t0:t1], keys], dim=2),
                            torch.cat([v[b:b + 1, :, t0:t1], values], dim=2),
                            attn_mask=allowed, scale=self.softmax_scale, enable_gqa=gqa))
                    end = stop
                if end < q.shape[2]:
                    parts.append(v.new_zeros(1, q.shape[1], q.shape[2] - end, v.shape[3]))
                rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
            return torch.cat(rows) if len(rows) > 1 else rows[0]

    return TorchSDPAttention


class _SiluGateTimesProbs(torch.autograd.Function):
    """silu(gate) * up * probs[:, None] of fused = [gate | up], one autograd node whose
    backward writes both halves' gradients into one tensor: autograd's chunk backward
    concatenated them (a copy of [tokens x 2f] a layer). The same ops as autograd runs on
    the composite, so the same values bit for bit (tests/test_cpu_compat.py)."""

    @staticmethod
    def forward(ctx, fused, probs):
        gate, up = fused.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate)
        gated = act * up
        p = probs.unsqueeze(-1)
        ctx.save_for_backward(gate, up, act, gated, p)
        return gated * p

    @staticmethod
    def backward(ctx, g):
        gate, up, act, gated, p = ctx.saved_tensors
        half = gate.shape[-1]
        grad = g.new_empty(*g.shape[:-1], 2 * half)
        g_gated = g * p
        g_probs = (g * gated).sum(-1) if ctx.needs_input_grad[1] else None
        torch.ops.aten.silu_backward.grad_input(g_gated * up, gate, grad_input=grad[..., :half])
        torch.mul(g_gated, act, out=grad[..., half:])
        return grad, g_probs


@functools.cache
def grouped_experts() -> type:
    """Megatron's `SequentialMLP` (same parameters and checkpoint names) computed by torch's
    `grouped_mm`: two GEMMs over all local experts instead of a Python loop that runs one MLP
    module per expert, forward and backward. Expert linears never communicate inside the
    experts (the dispatcher does), so this is the same math; configurations with biases, FP8,
    clamped or offset GLUs, or probabilities applied on the input run megatron's loop. The
    SwiGLU between the GEMMs is one autograd node (`_SiluGateTimesProbs`)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    class GroupedExperts(SequentialMLP):
        def _loops(self, tokens: torch.Tensor) -> bool:
            cfg, first = self.config, self.local_experts[0]
            return (self.num_local_experts == 1 or tokens.shape[0] == 0 or cfg.fp8 or cfg.fp4
                    or cfg.moe_apply_probs_on_input or not cfg.gated_linear_unit
                    or cfg.activation_func_clamp_value is not None or cfg.glu_linear_offset
                    or cfg.use_te_activation_func or cfg.bias_activation_fusion
                    or first.linear_fc1.bias is not None or first.linear_fc2.bias is not None)

        def forward(self, tokens, tokens_per_expert, probs):
            if self._loops(tokens):
                return super().forward(tokens, tokens_per_expert, probs)
            grouped_mm = torch.nn.functional.grouped_mm
            offsets = torch.cumsum(tokens_per_expert.to(tokens.device), 0, dtype=torch.int32)
            fc1 = torch.stack([e.linear_fc1.weight.t() for e in self.local_experts])  # [E,h,2f]
            fc2 = torch.stack([e.linear_fc2.weight.t() for e in self.local_experts])  # [E,f,h]
            fused = grouped_mm(tokens, fc1, offs=offsets)  # [n, 2f]: gate | up
            if (self.config.activation_func is torch.nn.functional.silu
                    and fused.dtype == probs.dtype == tokens.dtype):
                inter = _SiluGateTimesProbs.apply(fused, probs)
            else:
                gate, up = fused.chunk(2, dim=-1)
                inter = (self.config.activation_func(gate) * up
                         * probs.unsqueeze(-1)).to(tokens.dtype)
            return grouped_mm(inter, fc2, offs=offsets), None

    return GroupedExperts


def _softmax_over_dim1(x: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the short second dim of [tokens, n], computed along the tokens: torch's
    CPU softmax over a short last dim runs per row ([2048, 4]: 83 us, against 6 us over dim 0
    of the transpose). Equal to `torch.softmax(x, -1)` within float32 rounding."""
    return torch.softmax(x.t().contiguous(), 0, dtype=torch.float32).t()


@functools.cache
def short_softmax_router() -> type:
    """Megatron's `TopKRouter`, its softmax top-k routing computed with `_softmax_over_dim1`
    and one top-k a layer instead of two. Megatron takes the aux loss's routing map from a
    second top-k over softmax(logits); the softmax is monotone, so that map is the routing's
    own (taken from the logits, as megatron routes when not pre-softmax). Same experts for
    every token; the probabilities and the aux loss within float32 rounding of megatron's.
    A training step of tiny-moe at 8x256 on CPU: 40.1 -> 38.9 ms. Grouped or biased top-k,
    other score functions, fusion and routing replay run megatron's `routing`."""
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping
    from megatron.core.transformer.moe.router import TopKRouter

    class ShortSoftmaxRouter(TopKRouter):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            cfg = self.config
            self.short_softmax = (
                self.score_function == "softmax" and self.expert_bias is None
                and self.router_replay is None and not cfg.moe_router_fusion
                and not cfg.moe_router_group_topk
                and self.routing_type not in ("sinkhorn", "quantile_balancing"))

        def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
            if not self.short_softmax:
                return super().routing(logits, padding_mask=padding_mask)
            cfg = self.config
            seq_length, bsz = logits.shape[:2]
            logits = logits.view(-1, cfg.num_moe_experts)
            if padding_mask is not None:
                padding_mask = padding_mask.reshape(-1)
            logits = self.apply_z_loss(logits, padding_mask=padding_mask)
            aux = self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled()
            scores = _softmax_over_dim1(logits) if aux or cfg.moe_router_pre_softmax else None
            if cfg.moe_router_pre_softmax:
                probs, top = torch.topk(scores, k=self.topk, dim=1)
            else:
                top = torch.topk(logits, k=self.topk, dim=1)[1]
                probs = _softmax_over_dim1(logits.gather(1, top))
            if cfg.moe_router_topk_scaling_factor:
                probs = probs * cfg.moe_router_topk_scaling_factor
            routing_map = chosen = torch.zeros(logits.shape, dtype=torch.bool,
                                               device=logits.device).scatter_(1, top, True)
            probs = torch.zeros_like(logits).scatter(1, top, probs.type_as(logits))
            if cfg.moe_expert_capacity_factor is not None:
                probs, routing_map = apply_router_token_dropping(
                    probs, routing_map, router_topk=self.topk,
                    capacity_factor=cfg.moe_expert_capacity_factor,
                    drop_policy=cfg.moe_token_drop_policy,
                    pad_to_capacity=cfg.moe_pad_expert_input_to_capacity)
            if aux:  # megatron's own losses, on its inputs (padding masked out of both)
                aux_map = chosen  # before any token dropping, as megatron's
                if padding_mask is not None:
                    valid = (~padding_mask).unsqueeze(-1)
                    aux_map, scores = aux_map * valid, scores * valid
                masked = padding_mask is not None
                probs = self._apply_aux_loss(probs, scores, aux_map, with_padding_mask=masked)
                probs = self._apply_seq_aux_loss(probs, scores, aux_map, seq_length, bsz,
                                                 with_padding_mask=masked)
                probs = self._apply_global_aux_loss(probs, scores, aux_map,
                                                    with_padding_mask=masked)
            return probs, routing_map

    return ShortSoftmaxRouter


def _permute_by_expert(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor,
                       num_out: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's `permute` (tokens grouped by expert, each expert's in token order; their
    probabilities; the token of each row), its indices taken with `nonzero` where megatron
    runs a stable argsort over every (expert, token) pair: the same indices when every token
    picks its `topk` experts (no drops), in ~1/10 of the time on CPU ([8192]: 180 -> 15 us).
    Elsewhere (a drop, a GPU, where nonzero waits for the device) megatron's own."""
    flat = routing_map.t().reshape(-1).nonzero().squeeze(1) if tokens.is_cpu else None
    if flat is None or flat.numel() != num_out:
        from megatron.core.transformer.moe.moe_utils import permute

        permuted, permuted_probs, order, _, _ = permute(tokens, routing_map, probs=probs,
                                                        num_out_tokens=num_out)
        return permuted, permuted_probs, order
    order = flat % tokens.shape[0]
    return (tokens.index_select(0, order), probs.t().reshape(-1).index_select(0, flat), order)


@functools.cache
def single_rank_moe() -> type:
    """Megatron's `MoELayer` that, when this rank holds every expert and every token it routes
    (EP, expert-TP and attention-TP 1), computes what its all-to-all dispatcher computes there,
    route → permute → experts → unpermute with megatron's own `permute`/`unpermute`, without
    the dispatcher's communication bookkeeping: split sizes, one-rank all-to-alls (autograd
    nodes that return their input) and device-sync points, ~0.3 ms a layer forward and
    backward on CPU. Every other configuration runs megatron's forward."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import unpermute
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    class SingleRankMoELayer(MoELayer):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            cfg, d = self.config, self.token_dispatcher
            self.single_rank = (
                type(d) is MoEAlltoAllTokenDispatcher and d.ep_size == 1 and d.tp_size == 1
                and self.attn_tp_group.size() == 1 and not d.drop_and_pad
                and cfg.moe_expert_capacity_factor is None
                and not cfg.moe_router_padding_for_quantization and not cfg.moe_permute_fusion
                and not cfg.moe_latent_size and not self.moe_layer_recompute
                and not self.shared_expert_overlap
                and not cfg.overlap_dispatch_backward_with_experts_wgrad
                and not hasattr(self, "_inference_token_dispatcher"))

        def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
            if (not self.single_rank or intermediate_tensors is not None
                    or self.fwd_execution_map != ["route", "expert_compute", "postprocess"]):
                return super().forward(hidden_states, intermediate_tensors, padding_mask)
            if padding_mask is not None:  # [b, s] → [s, b] like hidden_states
                padding_mask = padding_mask.transpose(0, 1).bool()
            shared = self.shared_experts_compute(hidden_states)
            probs, routing_map = self.route(hidden_states, padding_mask)
            tokens = hidden_states.view(-1, hidden_states.shape[-1])
            permuted, permuted_probs, order = _permute_by_expert(
                tokens, routing_map, probs, routing_map.size(0) * self.config.moe_router_topk)
            out, bias = self.experts(permuted, routing_map.sum(dim=0).long(), permuted_probs)
            assert bias is None, "mlp_bias is not supported by the MoE layer"
            out = unpermute(out, order, restore_shape=tokens.shape,
                            routing_map=routing_map).view(hidden_states.shape)
            return (out if shared is None else out + shared), None

    return SingleRankMoELayer


def _plain_gdn_out_norm():
    from megatron.core.transformer.spec_utils import ModuleSpec

    # Qwen3.5's GDN output norm is a plain RMSNorm (ones-initialised) even though every other
    # norm is zero-centred; keeping it plain makes HF ⇄ Megatron a bit-exact copy
    return ModuleSpec(module=RMSNorm, params={"zero_centered": False})


def block_spec(spec: ModelSpec, config: Any, use_te: bool):
    """The `transformer_layer_spec` GPTModel takes for this rank's pipeline stage."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        if spec.linear_attention is not None:
            from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
                get_transformer_block_with_experimental_attention_variant_spec,
            )
            block = get_transformer_block_with_experimental_attention_variant_spec(config)
            for layer in block.layer_specs:  # TE would make the GDN output norm (1+w) too
                mixer = layer.submodules.self_attention
                if hasattr(mixer.submodules, "out_norm"):
                    mixer.submodules.out_norm = PlainTENorm
            return block
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=spec.num_experts, moe_grouped_gemm=True, qk_layernorm=spec.qk_layernorm)
    return _local_block_spec(spec, config)


def _local_block_spec(spec: ModelSpec, config: Any):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    mlp = get_mlp_module_spec_for_backend(LocalSpecProvider(), num_experts=spec.num_experts,
                                          moe_grouped_gemm=False)
    if spec.is_moe:  # megatron hands back partials: swap the classes, keep their args
        moe = mlp.keywords["submodules"]
        moe.experts = functools.partial(grouped_experts(), *moe.experts.args,
                                        **moe.experts.keywords)
        moe.router = short_softmax_router()
        mlp = functools.partial(single_rank_moe(), *mlp.args, **mlp.keywords)
    kinds = spec.layer_types
    if "linear_attention" in kinds:
        from megatron_rl.models import cpu_compat

        cpu_compat.ensure_gdn_kernels()
    offset = get_transformer_layer_offset(config)
    count = get_num_layers_to_build(config)
    layers = [_layer_spec(kinds[i], spec, mlp) for i in range(offset, offset + count)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm)


def _layer_spec(kind: str, spec: ModelSpec, mlp: Any):
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    if kind == "linear_attention":
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules

        mixer = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=_plain_gdn_out_norm(),
            out_proj=RowParallelLinear))
        keys = {"input_layernorm.": "self_attention.in_proj.layer_norm_"}
    else:
        qk_norm = RMSNorm if spec.qk_layernorm else IdentityOp
        mixer = ModuleSpec(
            module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=ColumnParallelLinear, core_attention=torch_sdpa_attention(),
                linear_proj=RowParallelLinear, q_layernorm=qk_norm, k_layernorm=qk_norm))
        keys = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if not spec.is_moe:  # TE fuses this norm into the dense fc1 (not into the MoE router)
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=RMSNorm, self_attention=mixer, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=RMSNorm, mlp=mlp, mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=keys))


def mtp_block_spec(spec: ModelSpec, config: Any, block: Any, use_te: bool):
    """Multi-token-prediction layers (Qwen3.5 ships one), built like the last decoder layer;
    None when the model has none or this pipeline stage does not hold them."""
    if not spec.mtp_num_layers:
        return None
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_mtp_block_spec,
        get_gpt_mtp_block_spec_for_backend,
    )

    if use_te:
        return get_gpt_mtp_block_spec(config, block, use_transformer_engine=True)

    class Local(LocalSpecProvider):
        def layer_norm(self, *args: Any, **kwargs: Any) -> type:
            return RMSNorm

    return get_gpt_mtp_block_spec_for_backend(config, block, backend=Local())
