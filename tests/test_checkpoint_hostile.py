"""Checkpoint and HF folders are untrusted input: nothing in them runs, every lie is named.

Hostile files are planted into real checkpoints written by the real code; the manifest is then
re-sealed (sizes and crc32 recomputed), as anyone who can write the folder can do.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.checkpoint import training_checkpoint as tc
from megatron_rl.checkpoint.errors import CheckpointError, HFCheckpointError
from megatron_rl.distributed.worker_pool import WorkerError
from tests import checkpoint_hostile_cases as hc
from tests import conversion_cases as cc
from tests import dist_cases
from tests.pools import get_pool


# -- helpers -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A real 1-rank checkpoint with model, Adam state, scheduler, RNG and progress."""
    root = tmp_path_factory.mktemp("hostile")
    pool = get_pool(1)
    pool.run(dist_cases.save_initial, str(root / "init"))
    pool.run(dist_cases.two_steps, [], str(root / "init" / "step_000000"), str(root / "run"))
    return root / "run" / "step_000001"


def _copy(src: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    target = tmp_path / name
    shutil.copytree(src, target)
    return target


def _reseal(folder: Path) -> None:
    """Recompute the manifest's file table for whatever the folder now holds."""
    manifest = json.loads((folder / tc.MANIFEST).read_text())
    manifest["files"] = {n: {"bytes": (folder / n).stat().st_size,
                             "crc32": tc._crc32(folder / n)} for n in tc._files(folder)}
    (folder / tc.MANIFEST).write_text(json.dumps(manifest))


def _real_metadata(folder: Path):
    with (folder / ".metadata").open("rb") as f:  # our own checkpoint, just written: trusted
        return pickle.load(f)


def _write_metadata(folder: Path, obj) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(obj))
    _reseal(folder)


def _load_error(folder: Path, job=dist_cases.full_parameters, *args) -> str:
    with pytest.raises(WorkerError) as info:
        get_pool(1).run(job, str(folder), *args)
    return str(info.value)


def _refused(folder: Path, marker: Path, job=dist_cases.full_parameters, *args) -> str:
    """The load's error; first of all, the planted payload must not have run."""
    try:
        get_pool(1).run(job, str(folder), *args)
        msg = ""
    except WorkerError as e:
        msg = str(e)
    assert not marker.exists(), "the planted payload ran"
    assert msg, "the hostile checkpoint loaded"
    return msg


# -- item 3: no code runs from a checkpoint -----------------------------------------------------
@pytest.mark.parametrize("where", ["whole", "nested"])
def test_planted_metadata_reduce_is_refused_by_load(ckpt, tmp_path, where):
    """`.metadata` whose pickle calls exec(): as the whole file, or inside a real Metadata."""
    folder, marker = _copy(ckpt, tmp_path), tmp_path / "pwned"
    if where == "whole":
        _write_metadata(folder, hc.Plant(str(marker)))
    else:
        metadata = _real_metadata(folder)
        metadata.storage_meta.checkpoint_id = hc.Plant(str(marker))
        _write_metadata(folder, metadata)
    msg = _refused(folder, marker)
    assert "CheckpointError" in msg and ".metadata" in msg and "builtins.exec" in msg, msg


def test_planted_metadata_is_refused_by_the_export_cli(ckpt, tmp_path):
    folder, marker, out = _copy(ckpt, tmp_path), tmp_path / "pwned", tmp_path / "hf"
    metadata = _real_metadata(folder)
    metadata.storage_meta.checkpoint_id = hc.Plant(str(marker))
    _write_metadata(folder, metadata)
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", "megatron-to-hf",
                           "--ckpt", str(folder), "--out", str(out), "--model", "tiny-moe"],
                          capture_output=True, text=True, timeout=600)
    assert not marker.exists(), "the planted payload ran"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ".metadata" in proc.stderr and "builtins.exec" in proc.stderr, proc.stderr[-3000:]
    assert not out.exists() and not (tmp_path / ".tmp-hf").exists()  # nothing half-written


def test_planted_common_state_is_refused(tmp_path):
    """megatron's common state (step, scheduler, progress) is a bytes entry DCP would
    torch.load with weights_only=False."""
    marker = tmp_path / "pwned"
    get_pool(1).run(hc.save_with_planted_progress, str(tmp_path / "run"), str(marker))
    msg = _refused(tmp_path / "run" / "step_000000", marker)
    assert "common_state" in msg and ".distcp" in msg and "builtins.exec" in msg, msg


def test_planted_rng_state_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    get_pool(1).run(hc.save_with_planted_rng, str(tmp_path / "run"), str(marker))
    msg = _refused(tmp_path / "run" / "step_000000", marker, hc.load_everything)
    assert "rng_state" in msg and "builtins.exec" in msg, msg


def test_legacy_common_pt_is_loaded_weights_only(ckpt, tmp_path):
    """megatron reads a legacy common.pt with a bare torch.load, which
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns into a full unpickle."""
    folder, marker = _copy(ckpt, tmp_path), tmp_path / "pwned"
    torch.save({"planted": hc.Plant(str(marker))}, folder / "common.pt")
    _reseal(folder)
    msg = _refused(folder, marker, hc.full_parameters_with_env,
                   {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    assert "common.pt" in msg and "builtins.exec" in msg, msg


def test_storage_entry_outside_the_folder_is_refused(ckpt, tmp_path):
    folder = _copy(ckpt, tmp_path)
    shutil.copy(folder / "__0_0.distcp", tmp_path / "outside.distcp")
    metadata = _real_metadata(folder)
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"
    _write_metadata(folder, metadata)
    msg = _load_error(folder)
    assert "CheckpointError" in msg and "../outside.distcp" in msg, msg


def test_a_real_load_never_unpickles_unrestricted(ckpt):
    """Model + optimizer + RNG: no pickle.load, and every torch.load is weights_only."""
    calls = get_pool(1).run(hc.unpickling_during_load, str(ckpt))[0]
    assert "pickle.load" not in calls, calls
    assert calls and all(c == "torch.load(weights_only=True)" for c in calls), sorted(set(calls))


def test_rng_state_and_step_count_still_round_trip(tmp_path):
    got = get_pool(1).run(hc.rng_and_step_round_trip, str(tmp_path / "run"))[0]
    assert got["after"] == got["before"] and got["scrambled"] != got["before"]
    assert got["loaded_steps"] == got["steps"] == 1


# -- item 3: the manifest lists every file ------------------------------------------------------
@pytest.mark.parametrize("text,expected", [
    (b"", "unreadable manifest"),
    (b"{}", "manifest lacks format_version, files"),
    (b"[]", "not a JSON object"),
    (b"null", "not a JSON object"),
    (b"\xff\xfe{}", "unreadable manifest"),
    (b'{"format_version": 1, "files": {}, "step": 1, "model": "tiny-moe", "layout": {}, '
     b'"contents": ["model"]}', "lists no files"),
    (b'{"format_version": 1, "files": {"metadata.json": {"bytes": 1, "crc32": "00000000"}}}',
     "manifest lacks step, model, layout, contents"),
    (b"[" * 100_000 + b"]" * 100_000, r"unreadable manifest \(JSON nested too deeply\)"),
    (b'{"format_version": 1, "step": 1' + b"0" * 5000 + b"}",
     r"unreadable manifest \(Exceeds the limit \(4300 digits\)"),
])
def test_malformed_manifest_is_refused(ckpt, tmp_path, text, expected):
    folder = _copy(ckpt, tmp_path)
    (folder / tc.MANIFEST).write_bytes(text)
    with pytest.raises(CheckpointError, match=expected) as info:
        tc.verify_checkpoint(folder)
    assert tc.MANIFEST in str(info.value)


@pytest.mark.parametrize("entry", ["../outside", "/etc/hostname"])
def test_manifest_entry_outside_the_folder_is_refused(ckpt, tmp_path, entry):
    folder = _copy(ckpt, tmp_path)
    manifest = json.loads((folder / tc.MANIFEST).read_text())
    manifest["files"][entry] = {"bytes": 1, "crc32": "00000000"}
    (folder / tc.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="is not a file of the checkpoint folder"):
        tc.verify_checkpoint(folder)


def test_empty_manifest_is_refused_by_load(ckpt, tmp_path):
    folder = _copy(ckpt, tmp_path)
    manifest = json.loads((folder / tc.MANIFEST).read_text())
    (folder / tc.MANIFEST).write_text(json.dumps({**manifest, "files": {}}))
    msg = _load_error(folder)
    assert "CheckpointError" in msg and "lists no files" in msg, msg


def test_unlisted_file_is_refused(ckpt, tmp_path):
    folder = _copy(ckpt, tmp_path)
    (folder / "notes.txt").write_text("not part of the save")
    with pytest.raises(CheckpointError, match="notes.txt: not listed in the manifest"):
        tc.verify_checkpoint(folder, mode="size")
    msg = _load_error(folder)
    assert "notes.txt: not listed in the manifest" in msg, msg


def test_symlinked_file_is_refused(ckpt, tmp_path):
    folder = _copy(ckpt, tmp_path)
    data = next(folder.glob("*.distcp"))
    shutil.move(data, tmp_path / "elsewhere.distcp")
    os.symlink(tmp_path / "elsewhere.distcp", data)
    with pytest.raises(CheckpointError, match=f"{data.name}: a symbolic link"):
        tc.verify_checkpoint(folder)


def test_listed_file_missing_or_changed_is_named(ckpt, tmp_path):
    folder = _copy(ckpt, tmp_path)
    (folder / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="metadata.json: missing"):
        tc.verify_checkpoint(folder)
    folder = _copy(ckpt, tmp_path, "b")
    with (folder / "metadata.json").open("a") as f:
        f.write(" ")
    with pytest.raises(CheckpointError, match="metadata.json: .* bytes, expected"):
        tc.verify_checkpoint(folder)


# -- item 9: HF folders ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "tiny-moe"
    get_pool(1).run(cc.save_random_hf, "tiny-moe", str(out))
    return out


@pytest.fixture(scope="module")
def hf_sharded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "sharded"
    files = get_pool(1).run(hc.save_sharded_hf, "tiny-moe", str(out))[0]
    assert "model.safetensors.index.json" in files and len(files) >= 5, files
    return out


def _open_error(folder: Path) -> str:
    from megatron_rl.checkpoint.hf_io import HFCheckpoint

    with pytest.raises(HFCheckpointError) as info:
        HFCheckpoint(folder)
    return str(info.value)


def _import_error(folder: Path, tmp_path: Path) -> str:
    target = tmp_path / "target"
    with pytest.raises(HFCheckpointError) as info:
        cc.import_hf(str(folder), str(target), "tiny-moe", progress=False)
    assert not target.exists() and not list(tmp_path.glob(".tmp-target*"))
    return str(info.value)


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(path: Path, header: dict, data: bytes, lie_about_length: bool = False) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    length = len(text) + len(data) + 1 if lie_about_length else len(text)  # 1 past the end
    path.write_bytes(length.to_bytes(8, "little") + text + data)


def _tensors_in_file_order(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"),
                  key=lambda k: header[k]["data_offsets"][0])


def _lying(hf: Path, tmp_path: Path, lie: str) -> tuple[Path, str]:
    """A copy of `hf` whose safetensors header lies; returns (folder, tensor named)."""
    folder = _copy(hf, tmp_path, "lying")
    path = folder / "model.safetensors"
    header, data = _header(path)
    order = _tensors_in_file_order(header)
    if lie == "beyond":
        victim = order[-1]
        begin = header[victim]["data_offsets"][0]
        header[victim]["data_offsets"] = [begin, len(data) + 4096]
    elif lie == "shape":
        victim = next(k for k in order if header[k]["shape"][0] > 2)
        header[victim]["shape"][0] -= 1
    elif lie == "overlap":
        a, victim = next((a, b) for a, b in itertools.pairwise(order)
                         if header[a]["shape"] == header[b]["shape"])
        header[victim]["data_offsets"] = list(header[a]["data_offsets"])
    else:  # header length beyond the file
        victim = ""
    _write_header(path, header, data, lie_about_length=lie == "length")
    return folder, victim


@pytest.mark.parametrize("lie,expected", [
    ("beyond", "reach beyond the end of the file"), ("shape", "but its data_offsets span"),
    ("overlap", "overlaps tensor"), ("length", "header length .* is beyond the file")])
def test_lying_safetensors_header_names_file_and_tensor(hf, tmp_path, lie, expected):
    folder, victim = _lying(hf, tmp_path, lie)
    msg = _open_error(folder)
    assert str(folder / "model.safetensors") in msg and victim in msg, msg
    assert re.search(expected, msg), msg
    assert msg == _import_error(folder, tmp_path)


DEEP_JSON = b'{"a": ' * 100_000 + b"1" + b"}" * 100_000
HUGE_INT_JSON = b'{"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 1' + b"0" * 5000 + b"}"


@pytest.mark.parametrize("text,expected", [
    (b"[1, 2]", "not a JSON object"), (b'{"architectures": ', "not JSON"),
    (b"\xff\xfe{}", "not UTF-8"), (DEEP_JSON, "JSON nested too deeply"),
    (HUGE_INT_JSON, "not usable JSON (Exceeds the limit (4300 digits)")])
def test_bad_config_json_is_named(hf, tmp_path, text, expected):
    folder = _copy(hf, tmp_path)
    (folder / "config.json").write_bytes(text)
    msg = _open_error(folder)
    assert str(folder / "config.json") in msg and expected in msg, msg


@pytest.mark.parametrize("text", [DEEP_JSON, HUGE_INT_JSON, b"\xff{}"])
def test_bad_config_json_is_named_by_the_model_registry(hf, tmp_path, text):
    from megatron_rl.config.fields import ConfigError
    from megatron_rl.models.registry import spec_from_hf

    folder = _copy(hf, tmp_path)
    (folder / "config.json").write_bytes(text)
    with pytest.raises(ConfigError, match=re.escape(f"{folder / 'config.json'}: not a JSON file")):
        spec_from_hf(folder)


def _hostile_header(path: Path, text: bytes) -> None:
    """Replace the safetensors header of `path` by `text` (padded), keeping the data."""
    _, data = _header(path)
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize("where", ["index", "header"])
@pytest.mark.parametrize("text,expected", [
    (DEEP_JSON, "JSON nested too deeply"),
    (b'{"weight_map": {}, "n": 1' + b"0" * 5000 + b"}", "Exceeds the limit (4300 digits)")])
def test_deep_or_huge_int_json_in_the_index_or_a_header_names_the_file(
        hf_sharded, tmp_path, where, text, expected):
    folder = _copy(hf_sharded, tmp_path)
    if where == "index":
        path = folder / "model.safetensors.index.json"
        path.write_bytes(text)
    else:
        path = folder / _a_shard(folder)
        _hostile_header(path, text)
    msg = _open_error(folder)
    assert msg.startswith(str(path)) and expected in msg, msg
    if where == "header":
        assert "unreadable safetensors header" in msg, msg


def test_the_import_cli_shows_one_line_for_deep_json(hf, tmp_path, capsys):
    from megatron_rl.cli import main

    folder = _copy(hf, tmp_path)
    (folder / "config.json").write_bytes(DEEP_JSON)
    assert main(["convert", "hf-to-megatron", "--hf", str(folder), "--out",
                 str(tmp_path / "out"), "--model", "tiny-moe"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"megatron-rl: {folder / 'config.json'}: JSON nested too deeply", err
    assert not (tmp_path / "out").exists()


def _config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes", [{"architectures": None, "model_type": "llama"},
                                     {"architectures": None, "model_type": None},
                                     {"architectures": [], "model_type": "qwen3"}])
def test_missing_architectures_is_an_error(hf, tmp_path, changes):
    folder = _copy(hf, tmp_path)
    _config(folder, **changes)
    msg = _import_error(folder, tmp_path)
    assert "config.json: no 'architectures' list" in msg and "does not confirm" in msg, msg


def test_missing_architectures_passes_only_with_matching_model_type(hf, tmp_path):
    """The caller named the model and model_type confirms its family: the import proceeds.
    A caller that names no model types gets the error."""
    from megatron_rl.checkpoint.hf_io import HFCheckpoint
    from megatron_rl.checkpoint.weight_map import WeightMap
    from megatron_rl.models.registry import get_model_spec

    folder = _copy(hf, tmp_path)
    _config(folder, architectures=[])
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_moe"
    report = cc.import_hf(str(folder), str(tmp_path / "out"), "tiny-moe", progress=False)
    assert report["tensors"] > 0
    wmap = WeightMap(get_model_spec("tiny-moe"))
    with pytest.raises(HFCheckpointError, match="no 'architectures' list, so the model family"):
        HFCheckpoint(folder).check(wmap, ("Qwen3MoeForCausalLM",))


def _index(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def _point(folder: Path, old: str, new: str) -> None:
    index = _index(folder)
    index["weight_map"] = {k: new if v == old else v for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _a_shard(folder: Path) -> str:
    return sorted(set(_index(folder)["weight_map"].values()))[1]


@pytest.mark.parametrize("how", ["dotdot", "absolute", "subfolder", "symlink"])
def test_index_entries_must_stay_inside_the_folder(hf_sharded, tmp_path, how):
    folder = _copy(hf_sharded, tmp_path)
    shard = _a_shard(folder)
    outside = tmp_path / "outside"
    outside.mkdir()
    if how == "symlink":
        shutil.move(folder / shard, outside / shard)
        os.symlink(outside / shard, folder / shard)
        entry = shard
    elif how == "subfolder":
        (folder / "sub").mkdir()
        shutil.move(folder / shard, folder / "sub" / shard)
        entry = f"sub/{shard}"
    else:
        shutil.move(folder / shard, outside / shard)
        entry = f"../outside/{shard}" if how == "dotdot" else str(outside / shard)
    if entry != shard:
        _point(folder, shard, entry)
    msg = _import_error(folder, tmp_path)
    assert "model.safetensors.index.json" in msg and entry in msg, msg


def test_index_must_be_an_object_with_a_weight_map(hf_sharded, tmp_path):
    folder = _copy(hf_sharded, tmp_path)
    (folder / "model.safetensors.index.json").write_text("[]")
    assert "index.json: not a JSON object" in _open_error(folder)
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    assert "index.json: no weight_map" in _open_error(folder)


def test_index_entry_naming_the_wrong_shard(hf_sharded, tmp_path):
    folder = _copy(hf_sharded, tmp_path)
    index = _index(folder)
    name, file = next(iter(sorted(index["weight_map"].items())))
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != file)
    index["weight_map"][name] = other
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = _open_error(folder)
    assert f"tensor {name} is listed in {other}, which does not hold it" in msg, msg


def test_symlinks_inside_the_folder_and_the_hf_cache_layout_import(hf_sharded, tmp_path):
    """Links that stay inside the folder, and a hub cache snapshot (every file a link to
    ../../blobs/<hash>), are regular inputs."""
    folder = _copy(hf_sharded, tmp_path)
    shard = _a_shard(folder)
    shutil.move(folder / shard, folder / f".{shard}.blob")
    os.symlink(f".{shard}.blob", folder / shard)
    cc.import_hf(str(folder), str(tmp_path / "a"), "tiny-moe", progress=False)

    repo = tmp_path / "models--x--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(hf_sharded.iterdir())):
        shutil.copy(f, repo / "blobs" / f"{i:040x}")
        os.symlink(f"../../blobs/{i:040x}", snapshot / f.name)
    cc.import_hf(str(snapshot), str(tmp_path / "b"), "tiny-moe", progress=False)
    a = get_pool(1).run(dist_cases.full_parameters, str(tmp_path / "a"))[0]
    b = get_pool(1).run(dist_cases.full_parameters, str(tmp_path / "b"))[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
