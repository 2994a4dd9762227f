"""Model registry: one YAML per architecture under configs/models/, mapped both ways.

A `ModelSpec` holds the released architecture values. It maps to a transformers config (the
HF side of conversion and of the rollout engines) and, in `models.builder`, to a megatron-core
`TransformerConfig` (the training side). Both are derived from the same fields, so the two
sides cannot drift apart.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any

from megatron_rl.config.fields import bounded, check_bounds
from megatron_rl.config.loader import CONFIG_ROOT, ConfigError, from_dict, read_yaml

MODELS_DIR = CONFIG_ROOT / "models"

# architecture → (transformers config class, causal-LM class)
HF_CLASSES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}
# config.json `model_type` of each config class above (their `model_type`, pinned by a test):
# knowing it needs no import of transformers' model packages (a second of a conversion)
HF_MODEL_TYPES = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "qwen3_5_moe": "qwen3_5_moe_text"}


@dataclass
class LinearAttentionSpec:
    """Gated DeltaNet layers of the Qwen3.5 hybrid (3 linear + 1 full attention, repeating)."""

    full_attention_interval: int = bounded(4, ge=1)
    num_key_heads: int = bounded(16, ge=1)
    num_value_heads: int = bounded(32, ge=1)
    key_head_dim: int = bounded(128, ge=1)
    value_head_dim: int = bounded(128, ge=1)
    conv_kernel: int = bounded(4, ge=1)


@dataclass
class ModelSpec:
    name: str = ""
    architecture: str = bounded("qwen3_moe", choices=tuple(HF_CLASSES))
    hidden_size: int = bounded(64, ge=1)
    num_layers: int = bounded(2, ge=1)
    num_attention_heads: int = bounded(4, ge=1)
    num_query_groups: int = bounded(2, ge=1)
    head_dim: int = bounded(16, ge=1)
    ffn_hidden_size: int = bounded(128, ge=1, help="dense MLP width (all layers if no experts)")
    vocab_size: int = bounded(256, ge=2)
    max_position_embeddings: int = bounded(4096, ge=1)
    rope_theta: float = bounded(1e6, gt=0)
    rotary_percent: float = bounded(1.0, gt=0, le=1)
    norm_epsilon: float = bounded(1e-6, gt=0)
    qk_layernorm: bool = True
    tie_word_embeddings: bool = False
    # mixture of experts (None = dense)
    num_experts: int | None = bounded(None, ge=1)
    moe_router_topk: int | None = bounded(None, ge=1)
    moe_ffn_hidden_size: int | None = bounded(None, ge=1)
    shared_expert_ffn_hidden_size: int | None = bounded(None, ge=1)
    shared_expert_gate: bool = False
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = bounded(0.001, ge=0)
    # Qwen3.5 extras
    attention_output_gate: bool = False
    zero_centered_norm: bool = False
    linear_attention: LinearAttentionSpec | None = None
    mtp_num_layers: int = bounded(0, ge=0)
    source: str = bounded("", help="where the values come from")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def layer_types(self) -> list[str]:
        """Per layer: 'full_attention' or 'linear_attention'."""
        la = self.linear_attention
        if la is None:
            return ["full_attention"] * self.num_layers
        return ["full_attention" if (i + 1) % la.full_attention_interval == 0
                else "linear_attention" for i in range(self.num_layers)]

    def check(self, path: Path | str = "") -> None:
        where = f"{path}: " if path else ""
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"{where}num_attention_heads={self.num_attention_heads} is not a "
                              f"multiple of num_query_groups={self.num_query_groups}")
        moe = (self.num_experts, self.moe_router_topk, self.moe_ffn_hidden_size)
        if any(v is not None for v in moe) and any(v is None for v in moe):
            raise ConfigError(f"{where}num_experts, moe_router_topk and moe_ffn_hidden_size "
                              "must be set together")
        if self.is_moe and self.moe_router_topk > self.num_experts:
            raise ConfigError(f"{where}moe_router_topk={self.moe_router_topk} exceeds "
                              f"num_experts={self.num_experts}")
        if self.architecture == "qwen3" and self.is_moe:
            raise ConfigError(f"{where}architecture=qwen3 is dense; use qwen3_moe for experts")
        if self.architecture != "qwen3" and not self.is_moe:
            raise ConfigError(f"{where}architecture={self.architecture} needs num_experts")
        if (self.architecture == "qwen3_5_moe") != (self.linear_attention is not None):
            raise ConfigError(f"{where}linear_attention is required by (and only by) qwen3_5_moe")

    def num_parameters(self) -> int:
        """Total parameters, counted from the architecture (checked against transformers)."""
        h, v = self.hidden_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_query_groups * self.head_dim
        attn = h * q * (2 if self.attention_output_gate else 1) + 2 * h * kv + q * h
        attn += 2 * self.head_dim if self.qk_layernorm else 0
        if self.is_moe:
            mlp = h * self.num_experts + self.num_experts * 3 * h * self.moe_ffn_hidden_size
            if self.shared_expert_ffn_hidden_size:
                mlp += 3 * h * self.shared_expert_ffn_hidden_size
                mlp += h if self.shared_expert_gate else 0
        else:
            mlp = 3 * h * self.ffn_hidden_size
        total = 0
        for kind in self.layer_types:
            mixer = attn if kind == "full_attention" else self._linear_attention_params()
            total += mixer + mlp + 2 * h
        total += v * h * (1 if self.tie_word_embeddings else 2) + h
        return total

    def _linear_attention_params(self) -> int:
        la, h = self.linear_attention, self.hidden_size
        k_dim = la.num_key_heads * la.key_head_dim
        v_dim = la.num_value_heads * la.value_head_dim
        conv_dim = 2 * k_dim + v_dim
        return (h * conv_dim + h * v_dim + 2 * h * la.num_value_heads  # in_proj qkv, z, b, a
                + conv_dim * la.conv_kernel + 2 * la.num_value_heads  # conv1d, A_log, dt_bias
                + la.value_head_dim + v_dim * h)  # norm, out_proj

    def hf_config(self, **extra: Any):
        """The transformers config for this architecture (no weights are touched)."""
        import transformers

        cls = getattr(transformers, HF_CLASSES[self.architecture][0])
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        kw: dict[str, Any] = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_query_groups, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.norm_epsilon,
            tie_word_embeddings=self.tie_word_embeddings, hidden_act="silu",
            attention_bias=False,
        )
        if self.architecture in ("qwen3", "qwen3_moe"):
            kw["intermediate_size"] = self.ffn_hidden_size
        if self.is_moe:
            kw.update(num_experts=self.num_experts, num_experts_per_tok=self.moe_router_topk,
                      moe_intermediate_size=self.moe_ffn_hidden_size,
                      router_aux_loss_coef=self.router_aux_loss_coef)
        if self.architecture == "qwen3_moe":
            kw.update(norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1,
                      mlp_only_layers=[])
        if self.architecture == "qwen3_5_moe":
            la = self.linear_attention
            rope["partial_rotary_factor"] = self.rotary_percent
            kw.update(shared_expert_intermediate_size=self.shared_expert_ffn_hidden_size,
                      linear_conv_kernel_dim=la.conv_kernel,
                      linear_key_head_dim=la.key_head_dim,
                      linear_value_head_dim=la.value_head_dim,
                      linear_num_key_heads=la.num_key_heads,
                      linear_num_value_heads=la.num_value_heads,
                      layer_types=self.layer_types, mtp_num_hidden_layers=self.mtp_num_layers)
        kw["rope_parameters"] = rope
        kw.update(extra)
        config = cls(**kw)
        config.architectures = [HF_CLASSES[self.architecture][1]]
        return config


def available_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))


@cache
def get_model_spec(name: str) -> ModelSpec:
    """Load configs/models/<name>.yaml (or a YAML path) into a validated ModelSpec; a name that
    is no registry entry but an HF folder (a run from `model.hf_path`) gives that folder's spec
    (`spec_from_hf`)."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else MODELS_DIR / f"{name}.yaml"
    if not path.is_file() and Path(name, "config.json").is_file():
        return spec_from_hf(name)
    if not path.is_file():
        match = difflib.get_close_matches(name, available_models(), n=1)
        hint = f" (did you mean '{match[0]}'?)" if match else ""
        raise ConfigError(f"model.name='{name}': no registry entry {path}{hint}; "
                          f"known: {', '.join(available_models())}")
    data = read_yaml(path)
    data.setdefault("name", path.stem)
    try:
        spec = from_dict(ModelSpec, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    spec.check(path)
    return spec


# HF `architectures` entries → registry architecture; VL checkpoints keep the text model in
# `text_config` (Qwen3.5, and Qwen3.6 which shares its architecture)
HF_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_6MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_6MoeForConditionalGeneration": "qwen3_5_moe",
}


def _hf_value(cfg: dict[str, Any], where: str, *keys: str, default: Any = ...) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    if default is ...:
        raise ConfigError(f"{where}: missing {' / '.join(keys)}")
    return default


def spec_from_hf_config(config: dict[str, Any], where: str = "config.json") -> ModelSpec:
    """A `ModelSpec` from an HF `config.json` mapping (the text part of a VL checkpoint)."""
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: not a JSON object")
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ConfigError(f"{where}: no 'architectures' list, so the model family is unknown")
    known = [HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES]
    if not known:
        raise ConfigError(f"{where}: architectures {archs} are not supported; supported: "
                          f"{', '.join(HF_ARCHITECTURES)}")
    arch = known[0]
    text = config.get("text_config") or config
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: text_config is not a JSON object")

    def get(*keys: str, default: Any = ...) -> Any:
        return _hf_value(text, where, *keys, default=default)

    rope = get("rope_parameters", "rope_scaling", default={}) or {}
    heads = int(get("num_attention_heads"))
    kw: dict[str, Any] = dict(
        name=f"hf:{Path(where).parent.name or where}", architecture=arch,
        hidden_size=int(get("hidden_size")), num_layers=int(get("num_hidden_layers")),
        num_attention_heads=heads, num_query_groups=int(get("num_key_value_heads")),
        head_dim=int(get("head_dim", default=int(get("hidden_size")) // heads)),
        ffn_hidden_size=int(get("intermediate_size", "moe_intermediate_size")),
        vocab_size=int(get("vocab_size")),
        max_position_embeddings=int(get("max_position_embeddings")),
        rope_theta=float(rope.get("rope_theta", get("rope_theta", default=1e6))),
        rotary_percent=float(rope.get("partial_rotary_factor",
                                      get("partial_rotary_factor", default=1.0))),
        norm_epsilon=float(get("rms_norm_eps")), qk_layernorm=True,
        tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
        source=f"{where} ({', '.join(archs)})")
    if arch != "qwen3":
        kw.update(num_experts=int(get("num_experts", "num_local_experts")),
                  moe_router_topk=int(get("num_experts_per_tok")),
                  moe_ffn_hidden_size=int(get("moe_intermediate_size")),
                  norm_topk_prob=bool(get("norm_topk_prob", default=True)),
                  router_aux_loss_coef=float(get("router_aux_loss_coef", default=0.001)))
    if arch == "qwen3_5_moe":
        types = get("layer_types")
        interval = types.index("full_attention") + 1 if "full_attention" in types else 0
        expected = ["full_attention" if (i + 1) % max(interval, 1) == 0 else "linear_attention"
                    for i in range(len(types))]
        if not interval or types != expected:
            raise ConfigError(f"{where}: layer_types is not a repeating pattern of linear "
                              "layers ending in one full-attention layer")
        kw.update(shared_expert_ffn_hidden_size=int(get("shared_expert_intermediate_size")),
                  shared_expert_gate=True, attention_output_gate=True,
                  zero_centered_norm=True, mtp_num_layers=int(get("mtp_num_hidden_layers",
                                                                  default=0)),
                  linear_attention=LinearAttentionSpec(
                      full_attention_interval=interval,
                      num_key_heads=int(get("linear_num_key_heads")),
                      num_value_heads=int(get("linear_num_value_heads")),
                      key_head_dim=int(get("linear_key_head_dim")),
                      value_head_dim=int(get("linear_value_head_dim")),
                      conv_kernel=int(get("linear_conv_kernel_dim"))))
    try:
        spec = ModelSpec(**kw)
        for f in fields(ModelSpec):
            check_bounds(f"{where}: {f.name}", getattr(spec, f.name), f.metadata)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
    spec.check(where)
    return spec


def spec_from_hf(folder: str | Path) -> ModelSpec:
    """The registry entry of the HF checkpoint folder `folder`, from its config.json."""
    import json

    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"model.hf_path={str(folder)!r}: no config.json there")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # a ValueError too: the int digit limit
        raise ConfigError(f"{path}: not a JSON file ({type(e).__name__})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    return spec_from_hf_config(config, str(path))


def model_spec(model: Any) -> ModelSpec:
    """The spec a run's `model` section names: `model.hf_path`'s config.json, else the
    registry entry `model.name`."""
    return spec_from_hf(model.hf_path) if model.hf_path else get_model_spec(model.name)
