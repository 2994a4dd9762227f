"""Registry entries carry the released architecture values and map to both frameworks."""

from __future__ import annotations

import pytest

from megatron_rl.config.loader import ConfigError
from megatron_rl.config.schema import ModelConfig, ParallelConfig
from megatron_rl.models.builder import transformer_config
from megatron_rl.models.registry import HF_MODEL_TYPES, available_models, get_model_spec

# the table: hidden/layers, heads/kv/head_dim, experts/top-k, moe ffn/shared, vocab
RELEASED = {
    "qwen3-30b-a3b": (2048, 48, 32, 4, 128, 128, 8, 768, None, 151936),
    "qwen3-235b-a22b": (4096, 94, 64, 4, 128, 128, 8, 1536, None, 151936),
    "qwen3.5-35b-a3b": (2048, 40, 16, 2, 256, 256, 8, 512, 512, 248320),
    "qwen3.5-397b-a17b": (4096, 60, 32, 2, 256, 512, 10, 1024, 1024, 248320),
    "qwen3-4b": (2560, 36, 32, 8, 128, None, None, None, None, 151936),
    "qwen3-8b": (4096, 36, 32, 8, 128, None, None, None, None, 151936),
}
# total parameters (billions) implied by the architecture, as the model names say
SIZES = {"qwen3-30b-a3b": 30.5, "qwen3-235b-a22b": 235.1, "qwen3.5-35b-a3b": 34.7,
         "qwen3.5-397b-a17b": 396.3, "qwen3-4b": 4.02, "qwen3-8b": 8.19}


def test_every_required_entry_exists():
    assert set(RELEASED) | {"tiny-moe"} <= set(available_models())


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_values(name):
    s = get_model_spec(name)
    got = (s.hidden_size, s.num_layers, s.num_attention_heads, s.num_query_groups, s.head_dim,
           s.num_experts, s.moe_router_topk, s.moe_ffn_hidden_size,
           s.shared_expert_ffn_hidden_size, s.vocab_size)
    assert got == RELEASED[name]
    assert s.num_parameters() / 1e9 == pytest.approx(SIZES[name], abs=0.06)


def test_qwen35_specifics():
    s = get_model_spec("qwen3.5-35b-a3b")
    assert s.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert s.layer_types.count("full_attention") == 10
    assert (s.rotary_percent, s.rope_theta, s.mtp_num_layers) == (0.25, 1e7, 1)
    assert s.zero_centered_norm and s.attention_output_gate and s.shared_expert_gate
    la = get_model_spec("qwen3.5-397b-a17b").linear_attention
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.conv_kernel) == (16, 64,
                                                                                        128, 4)
    assert "triangulated" in (get_model_spec("qwen3.5-397b-a17b").source)
    assert get_model_spec("qwen3-4b").tie_word_embeddings
    assert not get_model_spec("qwen3-8b").tie_word_embeddings


@pytest.mark.parametrize("name", sorted(set(RELEASED) | {"tiny-moe"}))
def test_maps_to_transformers_config(name):
    s = get_model_spec(name)
    hf = s.hf_config()
    assert hf.hidden_size == s.hidden_size and hf.num_hidden_layers == s.num_layers
    assert hf.num_key_value_heads == s.num_query_groups and hf.head_dim == s.head_dim
    assert hf.vocab_size == s.vocab_size and hf.tie_word_embeddings == s.tie_word_embeddings
    assert hf.rope_parameters["rope_theta"] == s.rope_theta
    if s.is_moe:
        assert (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size) == (
            s.num_experts, s.moe_router_topk, s.moe_ffn_hidden_size)
    assert hf.model_type == HF_MODEL_TYPES[s.architecture]  # what conversions check, unimported
    if s.linear_attention:
        assert hf.layer_types == s.layer_types
        assert hf.linear_num_value_heads == s.linear_attention.num_value_heads
        assert hf.rope_parameters["partial_rotary_factor"] == 0.25


@pytest.mark.parametrize("name", sorted(set(RELEASED) | {"tiny-moe"}))
def test_maps_to_megatron_transformer_config(name):
    s = get_model_spec(name)
    tp = 2 if s.num_query_groups % 2 == 0 else 1
    parallel = ParallelConfig(tp=tp, ep=2 if s.is_moe else 1)
    cfg = transformer_config(s, ModelConfig(name=name, dtype="bf16"), parallel)
    assert (cfg.num_layers, cfg.hidden_size, cfg.kv_channels) == (s.num_layers, s.hidden_size,
                                                                   s.head_dim)
    assert cfg.num_query_groups == s.num_query_groups and cfg.qk_layernorm
    assert cfg.tensor_model_parallel_size == tp and cfg.sequence_parallel == (tp > 1)
    assert cfg.calculate_per_token_loss
    if s.is_moe:
        assert (cfg.num_moe_experts, cfg.moe_router_topk) == (s.num_experts, s.moe_router_topk)
        assert cfg.moe_router_pre_softmax is False  # Qwen normalises the top-k probabilities
    if s.linear_attention:
        assert cfg.experimental_attention_variant == "gated_delta_net"
        assert cfg.linear_attention_freq == 4 and cfg.attention_output_gate
        assert cfg.layernorm_zero_centered_gamma and cfg.mtp_num_layers == 1


def test_tiny_model_parameter_count_matches_transformers():
    import transformers

    s = get_model_spec("tiny-moe")
    model = transformers.AutoModelForCausalLM.from_config(s.hf_config())
    assert sum(p.numel() for p in model.parameters()) == s.num_parameters()


def test_tiny_qwen35_parameter_count_matches_transformers(tmp_path):
    import transformers

    (tmp_path / "m.yaml").write_text("""
architecture: qwen3_5_moe
hidden_size: 32
num_layers: 4
num_attention_heads: 4
num_query_groups: 2
head_dim: 8
ffn_hidden_size: 16
vocab_size: 64
rotary_percent: 0.25
num_experts: 4
moe_router_topk: 2
moe_ffn_hidden_size: 16
shared_expert_ffn_hidden_size: 16
shared_expert_gate: true
attention_output_gate: true
zero_centered_norm: true
linear_attention: {full_attention_interval: 4, num_key_heads: 2, num_value_heads: 4,
                   key_head_dim: 8, value_head_dim: 8, conv_kernel: 4}
""")
    s = get_model_spec(str(tmp_path / "m.yaml"))
    model = transformers.AutoModelForCausalLM.from_config(s.hf_config())
    assert sum(p.numel() for p in model.parameters()) == s.num_parameters()


def test_bad_registry_entries(tmp_path):
    with pytest.raises(ConfigError, match="model.name='tiny-mo'.*did you mean 'tiny-moe'"):
        get_model_spec("tiny-mo")
    bad = tmp_path / "bad.yaml"
    bad.write_text("architecture: qwen3_moe\nnum_attention_heads: 6\nnum_query_groups: 4\n"
                   "num_experts: 4\nmoe_router_topk: 2\nmoe_ffn_hidden_size: 8\n")
    with pytest.raises(ConfigError, match="bad.yaml: num_attention_heads=6 is not a multiple"):
        get_model_spec(str(bad))
    bad.write_text("architecture: qwen3_moe\nnum_expert: 4\n")
    with pytest.raises(ConfigError, match="did you mean 'num_experts'"):
        get_model_spec(str(bad))


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense", "tiny-qwen3.5"])
def test_spec_from_an_hf_folder_matches_the_registry(name, tmp_path):
    """`model.hf_path`: the registry entry is read off the folder's config.json, as
    transformers saved it, and (Qwen3.5) also from the released VL layout."""
    import dataclasses
    import json

    from megatron_rl.models.registry import spec_from_hf, spec_from_hf_config

    spec = get_model_spec(name)
    spec.hf_config().save_pretrained(tmp_path)
    got = spec_from_hf(tmp_path)
    skip = {"name", "source"}
    want = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in skip}
    assert {k: getattr(got, k) for k in want} == want
    if name == "tiny-qwen3.5":  # Qwen3_5MoeForConditionalGeneration keeps it in text_config
        text = json.loads((tmp_path / "config.json").read_text())
        vl = {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
              "model_type": "qwen3_5_moe", "text_config": text}
        assert spec_from_hf_config(vl).linear_attention == spec.linear_attention


def test_hf_config_errors_name_the_file(tmp_path):
    import json

    from megatron_rl.models.registry import spec_from_hf

    with pytest.raises(ConfigError, match="no config.json"):
        spec_from_hf(tmp_path)
    cfg = tmp_path / "config.json"
    cfg.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=f"{cfg}: not a JSON object"):
        spec_from_hf(tmp_path)
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ConfigError, match=f"{cfg}: no 'architectures' list"):
        spec_from_hf(tmp_path)
    cfg.write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"architectures \['LlamaForCausalLM'\] are not "
                                          r"supported; supported: Qwen3ForCausalLM"):
        spec_from_hf(tmp_path)
    good = get_model_spec("tiny-moe").hf_config().to_dict()
    cfg.write_text(json.dumps({**good, "num_experts_per_tok": 9, "num_local_experts": 4}))
    with pytest.raises(ConfigError, match="moe_router_topk=9 exceeds num_experts=4"):
        spec_from_hf(tmp_path)


def test_run_tokenizer_comes_from_the_hf_folder(tmp_path):
    from megatron_rl.agents.tokenizer import pad_id, run_tokenizer, tiny_qwen3_tokenizer

    tok = tiny_qwen3_tokenizer(vocab_size=512)
    tok.save_pretrained(tmp_path)
    got = run_tokenizer(str(tmp_path), "ignored", vocab_size=512)
    text = "<|im_start|>user\nWho? <tool_call>x</tool_call><|im_end|>"
    assert got.encode(text) == tok.encode(text) and got.chat_template == tok.chat_template
    assert pad_id(got) == tok.pad_token_id
    with pytest.raises(ValueError, match="its tokenizer has 512 tokens but the model's embedding "
                                         "holds 256"):
        run_tokenizer(str(tmp_path), "ignored", vocab_size=256)
    with pytest.raises(ValueError, match="model.name='qwen3-8b': set model.hf_path"):
        run_tokenizer(None, "qwen3-8b", vocab_size=151936)
    with pytest.raises(ValueError, match="no usable tokenizer there"):
        run_tokenizer(str(tmp_path / "nope"), "x", vocab_size=512)
