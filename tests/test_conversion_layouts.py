"""Released expert layouts: per-expert, Qwen3.5 (fused decoder experts, per-expert MTP) and
Qwen3.6 (MTP fused too). Folders are written from transformers' in-memory (fused) state dict,
since `save_pretrained` writes per-expert keys only; each imports to the same Megatron weights,
gives transformers' logits, and exports back to its own keys bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_rl.checkpoint.errors import HFCheckpointError, WeightMapError
from tests import conversion_cases as cc
from tests.pools import get_pool
from tests.test_conversion import _rewrite

TOL = 1e-4
MODELS = {"tiny-qwen3.5": list(cc.RELEASE_LAYOUTS), "tiny-moe": ["per_expert", "qwen3.5"]}
CASES = [(m, layout) for m, layouts in MODELS.items() for layout in layouts]
EP2 = ["parallel.ep=2"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, Path]]:
    """(model, layout) → (HF folder, its TP1 import); one set of random weights per model."""
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for model, layout in CASES:
        hf, mcore = root / f"{model}-{layout}-hf", root / f"{model}-{layout}-mcore"
        cc.save_layout_hf(model, str(hf), *cc.RELEASE_LAYOUTS[layout])
        cc.import_hf(str(hf), str(mcore), model, progress=False)
        out[(model, layout)] = (hf, mcore)
    return out


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _megatron_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from megatron_rl.checkpoint.convert import read_metadata, read_regions

    meta = {k: v for k, v in read_metadata(folder).items() if hasattr(v, "size")}
    return read_regions(folder, {k: ((0,) * len(v.size), tuple(v.size))
                                 for k, v in meta.items()}, meta)


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


# -- the released layouts ----------------------------------------------------------------------
def test_written_folders_have_the_released_keys(folders):
    keys = {c: set(cc.read_safetensors(str(hf))) for c, (hf, _) in folders.items()}
    g, m = "model.layers.1.mlp.experts", "mtp.layers.0.mlp.experts"
    assert {f"{g}.gate_up_proj", f"{g}.down_proj"} <= keys[("tiny-qwen3.5", "qwen3.5")]
    assert f"{m}.0.gate_proj.weight" in keys[("tiny-qwen3.5", "qwen3.5")]
    assert f"{m}.gate_up_proj" in keys[("tiny-qwen3.5", "qwen3.6")]
    assert not any(k.endswith("_proj") for k in keys[("tiny-qwen3.5", "per_expert")])
    assert f"{g}.gate_up_proj" in keys[("tiny-moe", "qwen3.5")]


def test_per_expert_folder_is_what_save_pretrained_writes(folders, tmp_path):
    """The test's own unfusing agrees with transformers' save-time conversion."""
    hf, _ = folders[("tiny-moe", "per_expert")]
    cc.save_random_hf("tiny-moe", str(tmp_path / "sp"))
    _assert_same_tensors(cc.read_safetensors(str(hf)),
                         cc.read_safetensors(str(tmp_path / "sp")))


def test_transformers_loads_the_fused_folders_exactly(folders):
    """transformers reads the fused keys as they are, to the very weights it converts the
    per-expert keys into (nothing left at its initial value)."""
    pool = get_pool(1)
    for model, layouts in MODELS.items():
        want = pool.run(cc.hf_state, str(folders[(model, "per_expert")][0]))[0]
        for layout in layouts[1:]:
            hf, _ = folders[(model, layout)]
            state = pool.run(cc.hf_state, str(hf))[0]
            _assert_same_tensors(state, want)
            fused = {k: v for k, v in cc.read_safetensors(str(hf)).items()
                     if k.startswith("model.") and k.endswith(("gate_up_proj", "down_proj"))}
            assert len(fused) == 2 * (4 if model == "tiny-qwen3.5" else 2)
            assert all(torch.equal(state[k], v) for k, v in fused.items())


@pytest.mark.parametrize("model,layout", CASES)
def test_detected_layout_is_recorded_per_group(model, layout, folders):
    _, mcore = folders[(model, layout)]
    experts, mtp = cc.RELEASE_LAYOUTS[layout]
    layers = 4 if model == "tiny-qwen3.5" else 2
    expected = {f"model.layers.{i}.mlp.experts": experts for i in range(layers)}
    if model == "tiny-qwen3.5":
        expected["mtp.layers.0.mlp.experts"] = mtp
    assert _manifest(mcore)["hf_layout"] == expected


@pytest.mark.parametrize("model,layout", [c for c in CASES if c[1] != "per_expert"])
def test_every_layout_imports_the_same_megatron_weights(model, layout, folders):
    """Fused groups (decoder and MTP) import to exactly the per-expert folder's tensors, so
    gate/up order and orientation match the per-expert path key for key."""
    want = _megatron_tensors(folders[(model, "per_expert")][1])
    _assert_same_tensors(_megatron_tensors(folders[(model, layout)][1]), want)


@pytest.mark.parametrize("parallel", ["tp1", "ep2"])
@pytest.mark.parametrize("model,layout", CASES)
def test_logits_match_transformers(model, layout, parallel, folders):
    """transformers reading the folder (in its own layout) vs megatron reading the import."""
    hf, mcore = folders[(model, layout)]
    ids = cc.tokens(512)
    ref = get_pool(1).run(cc.hf_logits, str(hf), ids)[0]
    overrides, world = ([], 1) if parallel == "tp1" else (EP2, 2)
    results = get_pool(world).run(cc.megatron_logits, model, str(mcore), overrides, ids)
    for got in results:
        diff = (got - ref).abs().max().item()
        assert got.shape == ref.shape and diff <= TOL, (model, layout, parallel, diff)
    print(f"\n{model} {layout} {parallel}: max |Δlogit| = {diff:.2e}")


@pytest.mark.parametrize("model,layout", CASES)
def test_round_trip_is_bit_exact_in_the_source_layout(model, layout, folders, tmp_path):
    hf, mcore = folders[(model, layout)]
    report = cc.export_hf(str(mcore), str(tmp_path / "back"), model, progress=False)
    source = cc.read_safetensors(str(hf))
    _assert_same_tensors(cc.read_safetensors(str(tmp_path / "back")), source)
    assert report["tensors"] == len(source)
    assert report["hf_layout"] == _manifest(mcore)["hf_layout"]


@pytest.mark.parametrize("layout", list(cc.RELEASE_LAYOUTS))
def test_bf16_round_trip_is_bit_exact(layout, tmp_path):
    model = "tiny-qwen3.5"
    hf = tmp_path / "hf"
    cc.save_layout_hf(model, str(hf), *cc.RELEASE_LAYOUTS[layout], dtype=torch.bfloat16)
    source = cc.read_safetensors(str(hf))
    assert all(t.dtype == torch.bfloat16 for t in source.values())
    cc.import_hf(str(hf), str(tmp_path / "m16"), model, dtype="bf16", progress=False)
    cc.export_hf(str(tmp_path / "m16"), str(tmp_path / "b16"), model, progress=False)
    _assert_same_tensors(cc.read_safetensors(str(tmp_path / "b16")), source)
    # through an fp32 checkpoint and back to bf16
    cc.import_hf(str(hf), str(tmp_path / "m32"), model, dtype="fp32", progress=False)
    cc.export_hf(str(tmp_path / "m32"), str(tmp_path / "b32"), model, dtype="bf16",
                 progress=False)
    _assert_same_tensors(cc.read_safetensors(str(tmp_path / "b32")), source)


def test_groups_are_detected_one_by_one(tmp_path):
    """Layers may differ from one another: each group is exported as it came."""
    hf, mcore = tmp_path / "hf", tmp_path / "m"
    cc.save_layout_hf("tiny-moe", str(hf), "fused", per_expert_layers=(1,))
    cc.import_hf(str(hf), str(mcore), "tiny-moe", progress=False)
    assert _manifest(mcore)["hf_layout"] == {"model.layers.0.mlp.experts": "fused",
                                             "model.layers.1.mlp.experts": "per_expert"}
    cc.export_hf(str(mcore), str(tmp_path / "back"), "tiny-moe", progress=False)
    _assert_same_tensors(cc.read_safetensors(str(tmp_path / "back")),
                         cc.read_safetensors(str(hf)))


def test_layout_survives_a_training_checkpoint(folders, tmp_path):
    """import → a run loads it → the run's checkpoint → export: still the source's layout."""
    hf, mcore = folders[("tiny-qwen3.5", "qwen3.5")]
    step = Path(get_pool(1).run(cc.load_and_save, "tiny-qwen3.5", str(mcore),
                                str(tmp_path / "run"))[0])
    assert _manifest(step)["hf_layout"] == _manifest(mcore)["hf_layout"]
    cc.export_hf(str(step), str(tmp_path / "back"), "tiny-qwen3.5", progress=False)
    _assert_same_tensors(cc.read_safetensors(str(tmp_path / "back")),
                         cc.read_safetensors(str(hf)))


def test_export_layout_can_be_chosen(folders, tmp_path):
    hf_fused, _ = folders[("tiny-moe", "qwen3.5")]
    _, mcore_per = folders[("tiny-moe", "per_expert")]
    cc.export_hf(str(mcore_per), str(tmp_path / "f"), "tiny-moe", hf_layout="fused",
                 progress=False)
    _assert_same_tensors(cc.read_safetensors(str(tmp_path / "f")),
                         cc.read_safetensors(str(hf_fused)))
    table = {"model.layers.0.mlp.experts": "per_expert", "model.layers.1.mlp.experts": "fused"}
    cc.export_hf(str(mcore_per), str(tmp_path / "t"), "tiny-moe", hf_layout=table,
                 progress=False)
    names = set(cc.read_safetensors(str(tmp_path / "t")))
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
    with pytest.raises(WeightMapError, match="hf_layout='packed': choose one of"):
        cc.export_hf(str(mcore_per), str(tmp_path / "x"), "tiny-moe", hf_layout="packed")
    with pytest.raises(WeightMapError, match="no expert layout for group "
                                             "model.layers.1.mlp.experts"):
        cc.export_hf(str(mcore_per), str(tmp_path / "x"), "tiny-moe",
                     hf_layout={"model.layers.0.mlp.experts": "fused"})
    assert not (tmp_path / "x").exists()


def test_checkpoint_without_a_recorded_layout_exports_per_expert(folders, tmp_path):
    """Checkpoints from before layouts were recorded export as they always did."""
    from megatron_rl.checkpoint import training_checkpoint as tc

    hf_per, _ = folders[("tiny-moe", "per_expert")]
    _, mcore = folders[("tiny-moe", "qwen3.5")]
    old = tmp_path / "old"
    shutil.copytree(mcore, old)
    manifest = _manifest(old)
    del manifest["hf_layout"]
    tc._atomic_write(old / tc.MANIFEST, json.dumps(manifest))
    cc.export_hf(str(old), str(tmp_path / "back"), "tiny-moe", progress=False)
    _assert_same_tensors(cc.read_safetensors(str(tmp_path / "back")),
                         cc.read_safetensors(str(hf_per)))


# -- bad input ---------------------------------------------------------------------------------
_edited = _rewrite  # a copy of an HF folder with its tensors edited


def _import_error(hf: Path, tmp_path: Path, model: str = "tiny-qwen3.5") -> str:
    target = tmp_path / "target"
    with pytest.raises(HFCheckpointError) as info:
        cc.import_hf(str(hf), str(target), model, progress=False)
    assert not target.exists() and not list(tmp_path.glob(".tmp-target*"))
    return str(info.value)


def test_a_group_mixing_layouts_is_refused(folders, tmp_path):
    hf, _ = folders[("tiny-qwen3.5", "qwen3.5")]
    g = "model.layers.2.mlp.experts"
    mixed = _edited(hf, tmp_path, lambda t: t.update(
        {f"{g}.1.up_proj.weight": t[f"{g}.gate_up_proj"][1, 32:].clone()}))
    msg = _import_error(mixed, tmp_path)
    assert (f"routed-expert group {g} mixes per-expert tensors ({g}.1.up_proj.weight in "
            f"model.safetensors) with fused ones ({g}.down_proj in model.safetensors)") in msg


def test_a_mixed_mtp_group_is_refused(folders, tmp_path):
    hf, _ = folders[("tiny-qwen3.5", "qwen3.6")]
    m = "mtp.layers.0.mlp.experts"
    mixed = _edited(hf, tmp_path, lambda t: t.update(
        {f"{m}.0.down_proj.weight": t[f"{m}.down_proj"][0].clone()}))
    assert f"routed-expert group {m} mixes per-expert tensors" in _import_error(mixed, tmp_path)


@pytest.mark.parametrize("name", ["model.layers.3.mlp.experts.down_proj",
                                  "model.layers.0.mlp.experts.gate_up_proj",
                                  "mtp.layers.0.mlp.experts.gate_up_proj"])
def test_a_missing_fused_tensor_is_named(name, folders, tmp_path):
    hf, _ = folders[("tiny-qwen3.5", "qwen3.6")]
    missing = _edited(hf, tmp_path, lambda t: t.pop(name))
    assert f"missing tensor {name}" in _import_error(missing, tmp_path)


def test_a_missing_per_expert_mtp_tensor_is_named(folders, tmp_path):
    hf, _ = folders[("tiny-qwen3.5", "qwen3.5")]
    name = "mtp.layers.0.mlp.experts.3.gate_proj.weight"
    missing = _edited(hf, tmp_path, lambda t: t.pop(name))
    assert f"missing tensor {name}" in _import_error(missing, tmp_path)


def test_a_group_with_no_tensors_is_named(folders, tmp_path):
    hf, _ = folders[("tiny-qwen3.5", "qwen3.6")]
    m = "mtp.layers.0.mlp.experts"
    gone = _edited(hf, tmp_path, lambda t: [t.pop(f"{m}.{p}") for p in ("gate_up_proj",
                                                                       "down_proj")])
    msg = _import_error(gone, tmp_path)
    assert f"missing tensor {m}.0.down_proj.weight" in msg
    assert f"routed-expert group {m} has no tensors at all" in msg


def test_fused_tensor_shape_and_stray_names_are_checked(folders, tmp_path):
    hf, _ = folders[("tiny-moe", "qwen3.5")]
    g = "model.layers.1.mlp.experts"
    # Qwen3-VL-MoE stores gate_up_proj transposed ([E, H, 2I]): refused, not misread
    flipped = _edited(hf, tmp_path / "a", lambda t: t.update(
        {f"{g}.gate_up_proj": t[f"{g}.gate_up_proj"].transpose(1, 2).contiguous()}))
    assert (f"tensor {g}.gate_up_proj has shape [4, 64, 128], expected [4, 128, 64] for model "
            "'tiny-moe' (in model.safetensors)") in _import_error(flipped, tmp_path / "a",
                                                                  "tiny-moe")
    stray = _edited(hf, tmp_path / "b", lambda t: t.update(
        {f"{g}.gate_up_proj_bias": torch.zeros(4, 128)}))
    assert f"unexpected tensor {g}.gate_up_proj_bias" in _import_error(stray, tmp_path / "b",
                                                                       "tiny-moe")


def test_a_bad_recorded_layout_is_refused_by_export(folders, tmp_path):
    from megatron_rl.checkpoint import training_checkpoint as tc

    _, mcore = folders[("tiny-moe", "qwen3.5")]
    for i, (bad, expected) in enumerate([
            ("fused", "hf_layout 'fused' is not a JSON object"),
            ({"model.layers.0.mlp.experts": "fused", "model.layers.1.mlp.experts": "zipped"},
             "group model.layers.1.mlp.experts has layout 'zipped'"),
            ({"model.layers.9.mlp.experts": "fused"},
             "'model.layers.9.mlp.experts' is not a routed-expert group of model 'tiny-moe'")]):
        ckpt = tmp_path / f"c{i}"
        shutil.copytree(mcore, ckpt)
        manifest = _manifest(ckpt)
        manifest["hf_layout"] = bad
        tc._atomic_write(ckpt / tc.MANIFEST, json.dumps(manifest))
        with pytest.raises(WeightMapError) as info:
            cc.export_hf(str(ckpt), str(tmp_path / f"x{i}"), "tiny-moe")
        assert str(ckpt / "manifest.json") in str(info.value) and expected in str(info.value)
        assert not (tmp_path / f"x{i}").exists()


def test_a_bad_recorded_layout_is_refused_by_load(folders, tmp_path):
    from megatron_rl.checkpoint import training_checkpoint as tc
    from megatron_rl.distributed.worker_pool import WorkerError

    _, mcore = folders[("tiny-moe", "qwen3.5")]
    ckpt = tmp_path / "c"
    shutil.copytree(mcore, ckpt)
    manifest = _manifest(ckpt)
    manifest["hf_layout"] = ["fused"]
    tc._atomic_write(ckpt / tc.MANIFEST, json.dumps(manifest))
    with pytest.raises(WorkerError, match="hf_layout is not a table of expert group"):
        get_pool(1).run(cc.megatron_logits, "tiny-moe", str(ckpt), [], cc.tokens(512))
