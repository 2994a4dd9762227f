"""Blockwise FP8 HF checkpoints (megatron_rl/checkpoint/fp8.py, `megatron-rl convert fp8`):
dequantized weights against the originals, what stays in its dtype, the folder loading back,
atomic writes and hostile sources. Real tiny HF folders, real tensors, CPU (torch quantizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.checkpoint.errors import HFCheckpointError
from megatron_rl.checkpoint.fp8 import (
    FP8_DTYPE,
    REL_BOUND,
    dequantize_blockwise,
    dequantize_named,
    error_bound,
    normal_relative_error,
    quantize_blockwise,
    quantize_hf_checkpoint,
    quantize_named,
)
from megatron_rl.checkpoint.hf_io import HFCheckpoint
from megatron_rl.models.registry import get_model_spec
from tests.conversion_cases import save_random_hf


def _hf(root: Path, name: str) -> Path:
    folder = root / f"hf-{name}"
    save_random_hf(name, str(folder))
    tiny_qwen3_tokenizer(vocab_size=get_model_spec(name).vocab_size).save_pretrained(folder)
    return folder


def test_blockwise_scheme_is_within_the_e4m3_bound():
    g = torch.Generator().manual_seed(0)
    # partial edge blocks (300 x 200), a wide dynamic range, an all-zero block
    w = torch.randn(300, 200, generator=g) * torch.logspace(-4, 1, 200)
    w[:128, :128] = 0
    q, s = quantize_blockwise(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == (3, 2)
    assert s[0, 0].item() == 1.0  # zero block: scale 1, values exactly 0
    back = dequantize_blockwise(q, s)
    assert bool((back[:128, :128] == 0).all())
    err = (back - w).abs()
    assert bool((err <= error_bound(w, s)).all())
    rel = normal_relative_error(w, q, s)
    assert 0 < rel <= REL_BOUND, rel
    # each block's largest magnitude maps onto 448 exactly, so it comes back exactly
    blk = w[128:256, 128:200]
    i = blk.abs().argmax()
    assert back[128:256, 128:200].flatten()[i].item() == pytest.approx(
        blk.flatten()[i].item(), rel=1e-6)
    with pytest.raises(ValueError, match="2-D weight"):
        quantize_blockwise(torch.ones(4))


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-moe"])
def test_fp8_folder_dequantizes_to_the_originals_and_keeps_the_exclusions(name, tmp_path):
    import transformers

    src = _hf(tmp_path, name)
    out = tmp_path / f"{name}-fp8"
    report = quantize_hf_checkpoint(src, out, progress=False)
    assert report["backend"] == "torch"  # no nvidia-modelopt / CUDA here
    original = load_file(src / "model.safetensors")
    written = {}
    for f in sorted(out.glob("*.safetensors")):
        written.update(load_file(f))
    fp8 = {n for n, t in written.items() if t.dtype == FP8_DTYPE}
    assert report["fp8_tensors"] == len(fp8) > 0
    worst = 0.0
    for n in fp8:
        w, s = original[n], written[n + "_scale_inv"]
        back = dequantize_blockwise(written[n], s)
        assert bool(((back - w.float()).abs() <= error_bound(w, s)).all()), n
        worst = max(worst, normal_relative_error(w, written[n], s))
    assert 0 < worst <= REL_BOUND
    assert report["max_normal_relative_error"] == pytest.approx(worst)
    print(f"{name}: {len(fp8)} FP8 tensors, max relative error {worst:.4f}")
    # everything else is the original tensor, bit for bit, in its dtype
    kept = {n for n in written if n not in fp8 and not n.endswith("_scale_inv")}
    assert kept | fp8 == set(original)
    for n in kept:
        assert written[n].dtype == original[n].dtype and torch.equal(written[n], original[n]), n
    must_keep = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight",
                 "model.layers.0.post_attention_layernorm.weight", "model.layers.0.mlp.gate.weight"]
    must_fp8 = ["model.layers.0.mlp.experts.0.gate_proj.weight",
                "model.layers.0.mlp.experts.3.down_proj.weight"]
    if name == "tiny-qwen3.5":  # layer 0 is Gated DeltaNet, layer 3 gated full attention
        must_keep += [f"model.layers.0.linear_attn.{p}" for p in (
            "in_proj_a.weight", "in_proj_b.weight", "conv1d.weight", "A_log", "dt_bias",
            "norm.weight")]
        must_keep += ["model.layers.0.mlp.shared_expert_gate.weight", "mtp.fc.weight",
                      "mtp.norm.weight", "model.layers.3.self_attn.q_norm.weight"]
        must_fp8 += [f"model.layers.0.linear_attn.{p}.weight"
                     for p in ("in_proj_qkv", "in_proj_z", "out_proj")]
        must_fp8 += [f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkvo"]
        must_fp8 += ["model.layers.0.mlp.shared_expert.up_proj.weight",
                     "mtp.layers.0.mlp.experts.1.up_proj.weight"]
    else:
        must_fp8 += [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
    assert set(must_keep) <= kept, sorted(set(must_keep) - kept)
    assert set(must_fp8) <= fp8, sorted(set(must_fp8) - fp8)
    # config.json: the fields SGLang's Fp8Config.from_config reads, exclusions listed
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "fmt", "activation_scheme",
                               "weight_block_size")} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}
    skipped = set(qc["modules_to_not_convert"])
    assert "model.layers.0.mlp.gate" in skipped and "lm_head" in skipped
    if name == "tiny-qwen3.5":
        assert {"model.layers.0.linear_attn.in_proj_a", "model.layers.0.linear_attn.in_proj_b",
                "model.layers.1.mlp.shared_expert_gate", "mtp.fc"} <= skipped
    assert not any(m + ".weight" in fp8 for m in skipped)
    # loads back: our validating reader, transformers' config, the tokenizer copied along
    back = HFCheckpoint(out)
    assert back.get("model.layers.0.mlp.experts.0.gate_proj.weight").dtype == FP8_DTYPE
    config = transformers.AutoConfig.from_pretrained(str(out))
    assert config.quantization_config["weight_block_size"] == [128, 128]
    assert (out / "tokenizer_config.json").is_file()


def test_a_failing_run_leaves_no_folder_and_names_the_tensor(tmp_path):
    src = _hf(tmp_path, "tiny-moe")
    path = src / "model.safetensors"
    tensors = load_file(path)
    bad = "model.layers.1.self_attn.o_proj.weight"
    tensors[bad] = tensors[bad].clone()
    tensors[bad][3, 5] = float("nan")
    save_file(tensors, str(path), metadata={"format": "pt"})
    out = tmp_path / "fp8"
    with pytest.raises(HFCheckpointError, match=f"tensor {bad} holds non-finite values"):
        quantize_hf_checkpoint(src, out, progress=False)
    assert not out.exists() and not (tmp_path / ".tmp-fp8").exists()
    # a missing tensor: named before anything is written
    gone = "model.layers.0.mlp.experts.2.up_proj.weight"
    del tensors[gone]
    tensors[bad][3, 5] = 0.0
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match=f"missing tensor {gone}"):
        quantize_hf_checkpoint(src, out, progress=False)
    assert not out.exists() and not (tmp_path / ".tmp-fp8").exists()
    # an odd one: a projection that is not 2-D
    tensors[gone] = torch.zeros(32, 64)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(4)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match="model.layers.0.self_attn.k_proj.weight has "
                                                "shape"):
        quantize_hf_checkpoint(src, out, progress=False)
    out.mkdir()
    with pytest.raises(FileExistsError, match="exists"):
        quantize_hf_checkpoint(src, out, progress=False)


def test_an_fp8_source_is_refused(tmp_path):
    src = _hf(tmp_path, "tiny-moe")
    quantize_hf_checkpoint(src, tmp_path / "once", progress=False)
    with pytest.raises(HFCheckpointError,
                       match=r"already quantized \(quantization_config 'fp8'\)"):
        quantize_hf_checkpoint(tmp_path / "once", tmp_path / "twice", "tiny-moe",
                               progress=False)


def test_named_round_trip_for_weight_sync():
    g = torch.Generator().manual_seed(1)
    named = [("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64, generator=g)),
             ("model.layers.0.input_layernorm.weight", torch.randn(64, generator=g)),
             ("model.layers.0.mlp.gate.weight", torch.randn(4, 64, generator=g))]
    sent = list(quantize_named(named))
    assert [n for n, _ in sent] == ["model.layers.0.self_attn.q_proj.weight",
                                    "model.layers.0.self_attn.q_proj.weight_scale_inv",
                                    "model.layers.0.input_layernorm.weight",
                                    "model.layers.0.mlp.gate.weight"]
    back = dict(dequantize_named(sent, torch.float32))
    assert set(back) == {n for n, _ in named}
    for n, t in named:
        if n.endswith("q_proj.weight"):
            assert 0 < (back[n] - t).abs().max() <= (t.abs() * REL_BOUND + 1e-3).max()
        else:
            assert torch.equal(back[n], t)
    with pytest.raises(ValueError, match="is not in the bucket"):
        dequantize_named(sent[:1])


def test_cli_fp8_and_megatron_to_hf_fp8(tmp_path, capsys):
    from megatron_rl.checkpoint.convert import import_hf
    from megatron_rl.cli import main

    src = _hf(tmp_path, "tiny-moe")
    assert main(["convert", "fp8", "--hf", str(src), "--out", str(tmp_path / "a")]) == 0
    assert "torch quantizer" in capsys.readouterr().out
    import_hf(str(src), str(tmp_path / "mcore"), "tiny-moe", progress=False)
    assert main(["convert", "megatron-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out",
                 str(tmp_path / "b"), "--model", "tiny-moe", "--fp8"]) == 0
    a, b = HFCheckpoint(tmp_path / "a"), HFCheckpoint(tmp_path / "b")
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    assert b.get(name).dtype == FP8_DTYPE and set(a.names()) == set(b.names())
    # via bf16: within the bound of the original too (bf16 rounding is far below 1/16)
    w = load_file(src / "model.safetensors")[name]
    back = dequantize_blockwise(b.get(name), b.get(name + "_scale_inv"))
    assert bool(((back - w).abs() <= 2 * error_bound(w, b.get(name + "_scale_inv"))).all())
    assert not any(p.name.startswith(".bf16-") for p in tmp_path.iterdir())
    assert main(["convert", "fp8", "--hf", str(src), "--out", str(tmp_path / "a")]) == 2
    with pytest.raises(HFCheckpointError, match="is already torch.float8_e4m3fn"):
        list(quantize_named([(name, b.get(name))]))
