"""Build the Megatron policy (`GPTModel`) from a registry entry and a parallel layout."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from megatron_rl.config.schema import ModelConfig, ParallelConfig
from megatron_rl.models.layer_specs import block_spec, mtp_block_spec
from megatron_rl.models.logprobs import chunked_logprobs
from megatron_rl.models.registry import ModelSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transformer_engine_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def use_transformer_engine(model_cfg: ModelConfig) -> bool:
    if model_cfg.layer_impl == "transformer_engine":
        if not transformer_engine_available():
            raise RuntimeError("model.layer_impl=transformer_engine needs CUDA and the `gpu` "
                               "extra: pip install 'megatron-rl[gpu]'")
        return True
    return model_cfg.layer_impl == "auto" and transformer_engine_available()


# model.fp8 → megatron's TransformerConfig (fp8 format, fp8_recipe) and the compute capability
# the recipe's GEMMs need (FP8 tensor cores from Ada/Hopper 8.9; MXFP8 from Blackwell 10.0;
# TE's 128x128 block scaling from Hopper 9.0)
FP8_RECIPES: dict[str, tuple[str, str, tuple[int, int]]] = {
    "delayed": ("hybrid", "delayed", (8, 9)),      # e4m3 forward, e5m2 gradients
    "blockwise": ("e4m3", "blockwise", (9, 0)),
    "mxfp8": ("e4m3", "mxfp8", (10, 0)),
}


def fp8_problem(recipe: str, *, cuda: bool, capability: tuple[int, int] | None,
                te: bool, layer_impl: str = "auto") -> str | None:
    """Why `model.fp8=recipe` cannot run here (None: it can)."""
    if recipe not in FP8_RECIPES:
        return f"unknown recipe; choose one of {', '.join(FP8_RECIPES)}"
    if layer_impl == "local":
        return ("FP8 GEMMs come from Transformer Engine layers; set model.layer_impl=auto or "
                "transformer_engine")
    if not cuda:
        return "needs a CUDA GPU (none is visible); leave model.fp8 unset on CPU"
    if not te:
        return "needs Transformer Engine: pip install 'megatron-rl[gpu]'"
    need = FP8_RECIPES[recipe][2]
    if capability is None or tuple(capability) < need:
        have = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        return (f"the GPU has compute capability {have}; the {recipe} recipe needs >= "
                f"{need[0]}.{need[1]}" + (" (Blackwell)" if recipe == "mxfp8" else ""))
    return None


def fp8_settings(model_cfg: ModelConfig) -> dict[str, Any]:
    """TransformerConfig fields for `model.fp8` ({} when unset); a ConfigError saying why when
    this machine cannot run the recipe."""
    recipe = getattr(model_cfg, "fp8", None)
    if recipe is None:
        return {}
    from megatron_rl.config.fields import ConfigError

    cuda = torch.cuda.is_available()
    problem = fp8_problem(recipe, cuda=cuda,
                          capability=torch.cuda.get_device_capability() if cuda else None,
                          te=transformer_engine_available(), layer_impl=model_cfg.layer_impl)
    if problem is None:
        problem = _te_fp8_support(recipe)
    if problem is not None:
        raise ConfigError(f"model.fp8={recipe}: {problem}")
    fmt, name, _ = FP8_RECIPES[recipe]
    return {"fp8": fmt, "fp8_recipe": name}


def _te_fp8_support(recipe: str) -> str | None:
    """Transformer Engine's own verdict for this GPU and build, where it has one."""
    try:
        from transformer_engine.pytorch import fp8 as te_fp8
    except ImportError:
        return None
    check = {"delayed": "check_fp8_support", "blockwise": "check_fp8_block_scaling_support",
             "mxfp8": "check_mxfp8_support"}[recipe]
    fn = getattr(te_fp8, check, None)
    if fn is None:
        return None
    ok, reason = fn()
    return None if ok else f"Transformer Engine says: {reason}"


def padded_vocab_size(spec: ModelSpec, parallel: ParallelConfig) -> int:
    """Pad only as much as TP needs; padded ids are masked out of every softmax."""
    return math.ceil(spec.vocab_size / parallel.tp) * parallel.tp


def transformer_config(spec: ModelSpec, model_cfg: ModelConfig, parallel: ParallelConfig,
                       **overrides: Any):
    """The megatron-core TransformerConfig for `spec` at this parallel layout."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = DTYPES[model_cfg.dtype]
    on_gpu = torch.cuda.is_available()
    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_epsilon,
        layernorm_zero_centered_gamma=spec.zero_centered_norm,
        qk_layernorm=spec.qk_layernorm, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        attention_output_gate=spec.attention_output_gate,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep, expert_tensor_parallel_size=parallel.etp,
        context_parallel_size=parallel.cp, sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        # micro-batches of different lengths must cross pipeline stages
        variable_seq_lengths=parallel.pp > 1,
        # token-level loss over the whole global batch, whatever the layout
        calculate_per_token_loss=True,
        # fused kernels exist only on GPU
        bias_dropout_fusion=on_gpu, apply_rope_fusion=False, masked_softmax_fusion=on_gpu,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        # validated even for dense models (allgather refuses variable sequence lengths)
        moe_token_dispatcher_type=parallel.moe_dispatcher,
    )
    if spec.is_moe:
        aux = (spec.router_aux_loss_coef if model_cfg.router_aux_loss_coef is None
               else model_cfg.router_aux_loss_coef)
        kw.update(
            num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_router_topk,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            # Qwen: softmax over all experts → top-k → renormalise == top-k → softmax
            moe_router_pre_softmax=not spec.norm_topk_prob,
            moe_aux_loss_coeff=aux,
            moe_router_load_balancing_type="aux_loss" if aux else "none",
            moe_grouped_gemm=use_transformer_engine(model_cfg),
            moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=spec.shared_expert_gate,
        )
    if spec.linear_attention is not None:
        la = spec.linear_attention
        kw.update(experimental_attention_variant="gated_delta_net",
                  linear_attention_freq=la.full_attention_interval,
                  linear_conv_kernel_dim=la.conv_kernel, linear_key_head_dim=la.key_head_dim,
                  linear_value_head_dim=la.value_head_dim, linear_num_key_heads=la.num_key_heads,
                  linear_num_value_heads=la.num_value_heads)
    if spec.mtp_num_layers:
        kw["mtp_num_layers"] = spec.mtp_num_layers
    kw.update(fp8_settings(model_cfg))
    if model_cfg.recompute_activations and model_cfg.recompute_granularity == "selective":
        kw.update(recompute_granularity="selective")  # megatron's default module: core_attn
    elif model_cfg.recompute_activations:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt_model(spec: ModelSpec, model_cfg: ModelConfig, parallel: ParallelConfig,
                    **config_overrides: Any):
    """This rank's `GPTModel` stage (pre/post-process follow the pipeline stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(spec, model_cfg, parallel, **config_overrides)
    use_te = use_transformer_engine(model_cfg)
    block = block_spec(spec, config, use_te)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        mtp_block_spec=mtp_block_spec(spec, config, block, use_te),
        vocab_size=padded_vocab_size(spec, parallel),
        max_sequence_length=model_cfg.seq_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=spec.rotary_percent,
        rotary_base=int(spec.rope_theta),
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def logprob_output_processor(vocab_size: int, temperature: float = 1.0,
                             chunk_tokens: int = 4096, matmul_dtype: str | None = None):
    """A GPTModel `output_processor` that returns [b, s, 2] = (log p(label), entropy);
    `matmul_dtype` (a DTYPES key): the output layer's matmuls in it (`chunked_logprobs`)."""
    return partial(_logprob_output, vocab_size=vocab_size, temperature=temperature,
                   chunk_tokens=chunk_tokens,
                   matmul_dtype=DTYPES[matmul_dtype] if matmul_dtype else None)


def _logprob_output(*, hidden_states, output_layer, output_weight, labels, vocab_size,
                    temperature, chunk_tokens, matmul_dtype, keep=None, **_unused
                    ) -> torch.Tensor:
    weight = output_weight if output_weight is not None else output_layer.weight
    logp, ent = chunked_logprobs(hidden_states, weight, labels, vocab_size=vocab_size,
                                 sequence_parallel=output_layer.sequence_parallel,
                                 temperature=temperature, chunk_tokens=chunk_tokens, keep=keep,
                                 matmul_dtype=matmul_dtype)
    return torch.stack([logp, ent], dim=-1)
