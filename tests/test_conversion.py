"""HF ⇄ Megatron conversion: parity with transformers, exact round trips, loud bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_rl.checkpoint.errors import HFCheckpointError
from tests import conversion_cases as cc
from tests.pools import get_pool

TOL = 1e-4
LAYOUTS = {
    "tiny-moe": {"tp2-sp": ["parallel.tp=2"], "ep2": ["parallel.ep=2"], "pp2": ["parallel.pp=2"]},
    "tiny-dense": {"tp2-sp": ["parallel.tp=2"], "tp2": ["parallel.tp=2", "parallel.sp=false"],
                   "pp2": ["parallel.pp=2"]},
    "tiny-qwen3.5": {"tp2-sp": ["parallel.tp=2"], "ep2": ["parallel.ep=2"],
                     "pp2": ["parallel.pp=2"]},
}
ARCHITECTURES = {"tiny-moe": "Qwen3MoeForCausalLM", "tiny-dense": "Qwen3ForCausalLM",
                 "tiny-qwen3.5": "Qwen3_5MoeForCausalLM"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Per model: a random HF checkpoint, its logits, and its TP1 torch_dist import."""
    root = tmp_path_factory.mktemp("conv")
    pool = get_pool(1)
    out = {}
    for model in LAYOUTS:
        hf, mcore = root / f"{model}-hf", root / f"{model}-mcore"
        pool.run(cc.save_random_hf, model, str(hf))
        ids = cc.tokens(512)
        ref = pool.run(cc.hf_logits, str(hf), ids)[0]
        cc.import_hf(str(hf), str(mcore), model, progress=False)
        out[model] = (root, hf, mcore, ids, ref)
    return out


@pytest.mark.parametrize("model", list(LAYOUTS))
def test_logits_match_transformers_at_tp1(model, converted):
    _, _, mcore, ids, ref = converted[model]
    got = get_pool(1).run(cc.megatron_logits, model, str(mcore), [], ids)[0]
    diff = (got - ref).abs().max().item()
    print(f"\n{model} tp1: max |Δlogit| = {diff:.2e}")
    assert got.shape == ref.shape and diff <= TOL


@pytest.mark.parametrize("model,layout", [(m, k) for m, ls in LAYOUTS.items() for k in ls])
def test_logits_match_transformers_at_2_ranks(model, layout, converted):
    _, _, mcore, ids, ref = converted[model]
    results = get_pool(2).run(cc.megatron_logits, model, str(mcore), LAYOUTS[model][layout], ids)
    for got in results:
        diff = (got - ref).abs().max().item()
        assert diff <= TOL, (model, layout, diff)
    print(f"\n{model} {layout}: max |Δlogit| = {diff:.2e}")


@pytest.mark.parametrize("model", list(LAYOUTS))
def test_round_trip_is_bit_exact_and_reloads(model, converted, tmp_path):
    _, hf, mcore, _, _ = converted[model]
    back = tmp_path / "back"
    report = cc.export_hf(str(mcore), str(back), model)
    original, exported = cc.read_safetensors(str(hf)), cc.read_safetensors(str(back))
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
    assert any(k.startswith("mtp.") for k in original) == (model == "tiny-qwen3.5")
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[model]]
    assert (back / "generation_config.json").is_file()
    assert report["tensors"] == len(original)
    # save_pretrained writes per-expert keys: recorded so, exported so
    manifest = json.loads((mcore / "manifest.json").read_text())
    assert set(manifest["hf_layout"].values()) == ({"per_expert"} if model != "tiny-dense"
                                                   else set())
    assert report["hf_layout"] == manifest["hf_layout"]
    generated = get_pool(1).run(cc.hf_generates, str(back))[0]
    assert generated[:3] == [1, 2, 3] and len(generated) == 8


def test_import_streams_one_chunk_per_layer_and_expert(converted):
    """The import never holds the model: one checkpoint chunk per (tensor, layer[, expert]),
    each written as soon as it is read."""
    from torch.distributed.checkpoint import FileSystemReader

    _, _, mcore, _, _ = converted["tiny-moe"]
    meta = FileSystemReader(str(mcore)).read_metadata().state_dict_metadata
    fc1 = meta["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert tuple(fc1.size) == (2, 4, 128, 64)  # layers, experts, 2 × moe ffn, hidden
    assert sorted(tuple(c.offsets) for c in fc1.chunks) == [
        (layer, expert, 0, 0) for layer in range(2) for expert in range(4)]
    assert all(tuple(c.sizes) == (1, 1, 128, 64) for c in fc1.chunks)


def test_sharded_export_with_index_and_tokenizer(converted, tmp_path):
    _, hf, mcore, _, _ = converted["tiny-moe"]
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    out = tmp_path / "sharded"
    report = cc.export_hf(str(mcore), str(out), "tiny-moe", tokenizer_dir=str(tok),
                          max_shard_bytes=200_000)
    assert len(report["files"]) >= 3 and report["tokenizer_files"] == ["tokenizer_config.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(report["files"])
    assert all(torch.equal(a, b) for a, b in zip(
        cc.read_safetensors(str(hf)).values(), [cc.read_safetensors(str(out))[k] for k in
                                                cc.read_safetensors(str(hf))], strict=True))
    with pytest.raises(FileExistsError):
        cc.export_hf(str(mcore), str(out), "tiny-moe")


# -- bad input ---------------------------------------------------------------------------------
def _import_error(hf, tmp_path, model="tiny-moe") -> str:
    target = tmp_path / "target"
    with pytest.raises(HFCheckpointError) as info:
        cc.import_hf(str(hf), str(target), model, progress=False)
    assert not target.exists() and not list(tmp_path.glob(".tmp-target*"))  # nothing half-done
    return str(info.value)


def _rewrite(hf, tmp_path, edit):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "edited"
    shutil.copytree(hf, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


def test_bad_hf_input_names_the_problem(converted, tmp_path):
    _, hf, _, _, _ = converted["tiny-moe"]
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    missing = _rewrite(hf, tmp_path / "a", lambda t: t.pop(name))
    assert f"missing tensor {name}" in _import_error(missing, tmp_path / "a")
    extra = _rewrite(hf, tmp_path / "b", lambda t: t.update({"model.bogus.weight": t[name] * 1}))
    assert "unexpected tensor model.bogus.weight" in _import_error(extra, tmp_path / "b")
    shaped = _rewrite(hf, tmp_path / "c", lambda t: t.update({name: t[name][:10]}))
    assert f"tensor {name} has shape [10, 64], expected [64, 64]" in _import_error(
        shaped, tmp_path / "c")
    wrong = tmp_path / "d" / "wrong"
    shutil.copytree(hf, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (wrong / "config.json").write_text(json.dumps(cfg))
    assert "architecture ['LlamaForCausalLM'] does not match" in _import_error(
        wrong, tmp_path / "d")
    notckpt = tmp_path / "e" / "empty"
    notckpt.mkdir(parents=True)
    assert "is not an HF checkpoint: no config.json" in _import_error(notckpt, tmp_path / "e")


def test_incomplete_shard_set(converted, tmp_path):
    _, _, mcore, _, _ = converted["tiny-moe"]
    out = tmp_path / "multi"
    cc.export_hf(str(mcore), str(out), "tiny-moe", max_shard_bytes=200_000)
    victim = sorted(out.glob("model-*.safetensors"))[1]
    victim.unlink()
    assert f"incomplete shard set, missing {victim.name}" in _import_error(out, tmp_path)


def test_unsupported_architecture_is_refused(tmp_path):
    import dataclasses

    from megatron_rl.checkpoint.errors import WeightMapError
    from megatron_rl.checkpoint.weight_map import WeightMap
    from megatron_rl.models.registry import get_model_spec

    llama = dataclasses.replace(get_model_spec("tiny-dense"), architecture="llama")
    with pytest.raises(WeightMapError, match="no HF⇄Megatron weight map for architecture "
                                             "'llama'"):
        WeightMap(llama)


def test_vl_checkpoint_imports_its_text_part(converted, tmp_path):
    """Qwen3.5 ships as a VL model: text weights under model.language_model.*, a vision tower
    beside them. Import keeps the text policy and gives the text model's logits."""
    from safetensors.torch import load_file, save_file

    _, hf, _, ids, ref = converted["tiny-qwen3.5"]
    vl = tmp_path / "vl"
    vl.mkdir()
    text = load_file(str(hf / "model.safetensors"))
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in text.items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    save_file(tensors, str(vl / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    (vl / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": config}))
    mcore = tmp_path / "mcore"
    cc.import_hf(str(vl), str(mcore), "tiny-qwen3.5", progress=False)
    got = get_pool(1).run(cc.megatron_logits, "tiny-qwen3.5", str(mcore), [], ids)[0]
    assert (got - ref).abs().max().item() <= TOL


def test_cli_converters(converted, tmp_path):
    _, hf, _, _, _ = converted["tiny-dense"]
    mcore, back = tmp_path / "m", tmp_path / "h"
    run = [sys.executable, "tools/convert_hf_to_megatron.py", "--hf", str(hf), "--out",
           str(mcore), "--model", "tiny-dense"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "loads at any TP/PP/EP layout" in proc.stdout and "peak RSS" in proc.stdout
    proc = subprocess.run([sys.executable, "tools/convert_megatron_to_hf.py", "--ckpt",
                           str(mcore), "--out", str(back), "--model", "tiny-dense"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "MB/s" in proc.stdout
    a, b = cc.read_safetensors(str(hf)), cc.read_safetensors(str(back))
    assert all(torch.equal(a[k], b[k]) for k in a) and sorted(a) == sorted(b)
    bad = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", "megatron-to-hf",
                          "--ckpt", str(tmp_path / "nope"), "--out", str(tmp_path / "x"),
                          "--model", "tiny-dense"], capture_output=True, text=True)
    assert bad.returncode == 2 and "checkpoint folder not found" in bad.stderr
    # --model as an HF folder (a run from `model.hf_path`): its config.json sizes the model
    cli = [sys.executable, "-m", "megatron_rl.cli", "convert"]
    for argv in (["hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "m2")],
                 ["megatron-to-hf", "--ckpt", str(tmp_path / "m2"), "--out", str(tmp_path / "h2")]):
        proc = subprocess.run([*cli, *argv, "--model", str(hf)], capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    c = cc.read_safetensors(str(tmp_path / "h2"))
    assert all(torch.equal(a[k], c[k]) for k in a) and sorted(a) == sorted(c)
    proc = subprocess.run([*cli, "megatron-to-hf", "--ckpt", str(tmp_path / "m2"), "--out",
                           str(tmp_path / "h8"), "--model", str(hf), "--fp8"],
                          capture_output=True, text=True, timeout=600)  # and its FP8 twin
    assert proc.returncode == 0 and "blockwise FP8" in proc.stdout, proc.stderr[-2000:]
    # ... and the checkpoint of another model is refused, naming both
    bad = subprocess.run([*cli, "megatron-to-hf", "--ckpt", str(mcore), "--out",
                          str(tmp_path / "x"), "--model", str(hf)], capture_output=True, text=True)
    assert bad.returncode == 2 and "tiny-dense" in bad.stderr, bad.stderr[-2000:]


def test_cli_does_not_import_torch_for_config():
    code = "import sys, megatron_rl.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_failure_while_writing_leaves_nothing(converted, tmp_path):
    """A shard that turns unreadable after validation: the import fails naming it and no
    half-written folder stays at the target."""
    from megatron_rl.checkpoint import hf_io

    _, hf, _, _, _ = converted["tiny-moe"]
    target = tmp_path / "target"
    real_get = hf_io.HFCheckpoint.get
    calls = {"n": 0}

    def flaky(self, name):
        calls["n"] += 1
        if calls["n"] == 20:
            raise OSError(f"{self.path}/model.safetensors: read error")
        return real_get(self, name)

    hf_io.HFCheckpoint.get = flaky
    try:
        with pytest.raises(OSError, match="read error"):
            cc.import_hf(str(hf), str(target), "tiny-moe", progress=False)
    finally:
        hf_io.HFCheckpoint.get = real_get
    assert not target.exists() and not list(tmp_path.glob(".tmp-target*"))
