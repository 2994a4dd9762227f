"""Hugging Face checkpoints on disk: a validating lazy reader and a streaming shard writer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from megatron_rl.checkpoint.errors import HFCheckpointError
from megatron_rl.checkpoint.weight_map import FUSED, PER_EXPERT, HfLayout, WeightMap

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")
# VL checkpoints (e.g. Qwen3.5) keep the text model under this prefix
VL_TEXT_PREFIX = "model.language_model."


# bits per element of each safetensors dtype
_DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
               "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
               "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def _loads(raw: bytes, where: str) -> object:
    """JSON from untrusted bytes; every way it fails is an HFCheckpointError starting `where`:
    not UTF-8, not JSON, nested too deeply (RecursionError), an integer past Python's digit
    limit (a plain ValueError)."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise HFCheckpointError(f"{where}: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{where}: not JSON ({e})") from None
    except RecursionError:
        raise HFCheckpointError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # the int digit limit
        raise HFCheckpointError(f"{where}: not usable JSON ({str(e).split(';')[0]})") from None


def _read_json_object(path: Path) -> dict:
    """A JSON object from `path`, or HFCheckpointError naming the file."""
    data = _loads(path.read_bytes(), str(path))
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{path}: not a JSON object (found {type(data).__name__})")
    return data


def _member(folder: Path, name: object, where: Path) -> Path:
    """`folder/name` for a plain file name of the folder (`where` lists it). A symlink must
    stay inside the folder, or be a Hugging Face cache snapshot's link to its repo's blobs."""
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
            or "\x00" in name):
        raise HFCheckpointError(f"{where}: {name!r} is not a file name inside {folder}")
    path = folder / name
    if path.is_symlink():
        target, home = path.resolve(), folder.resolve()
        cache_blobs = (home.parent.parent / "blobs" if home.parent.name == "snapshots"
                       else None)
        if not (target.is_relative_to(home)
                or (cache_blobs is not None and target.parent == cache_blobs)):
            raise HFCheckpointError(f"{where}: {name} is a symlink to {target}, outside {folder}")
    return path


def _check_header(path: Path) -> dict[str, dict]:
    """The tensor table of a safetensors file, checked against the file: header length,
    every tensor's span inside the data, span = dtype × shape, no overlaps, no gaps."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HFCheckpointError(f"{path}: {size} bytes, too short for a safetensors file")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > _MAX_HEADER:
            raise HFCheckpointError(f"{path}: header length {n} is beyond the file "
                                    f"({size} bytes)")
        raw = f.read(n)
    header = _loads(raw, f"{path}: unreadable safetensors header")
    if not isinstance(header, dict):
        raise HFCheckpointError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    spans = []
    for name, info in header.items():
        where = f"{path}: tensor {name}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise HFCheckpointError(f"{where}: entry is not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _DTYPE_BITS:
            raise HFCheckpointError(f"{where}: unknown dtype {dtype!r}")
        if not (isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)):
            raise HFCheckpointError(f"{where}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise HFCheckpointError(f"{where}: data_offsets {offsets!r} are not [begin, end]")
        begin, end = offsets
        if end > data_bytes:
            raise HFCheckpointError(f"{where}: data_offsets {offsets} reach beyond the end of "
                                    f"the file ({data_bytes} data bytes)")
        numel = 1
        for d in shape:
            numel *= d
        if numel * _DTYPE_BITS[dtype] != 8 * (end - begin):
            raise HFCheckpointError(f"{where}: {dtype} {shape} needs "
                                    f"{numel * _DTYPE_BITS[dtype] / 8:g} bytes, but its "
                                    f"data_offsets span {end - begin}")
        spans.append((begin, end, name))
    at, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin < at:
            raise HFCheckpointError(f"{path}: tensor {name} overlaps tensor {previous} "
                                    f"(bytes {begin}..{at})")
        if begin > at:
            raise HFCheckpointError(f"{path}: {begin - at} unaccounted bytes before tensor "
                                    f"{name}")
        at, previous = end, name
    if at != data_bytes:
        raise HFCheckpointError(f"{path}: {data_bytes - at} bytes after the last tensor")
    return header


class HFCheckpoint:
    """Reads tensors one at a time (memory ~ one tensor), checking the folder up front: the
    folder is untrusted input, so every file, header and index entry is checked before use
    and each error names the file (and tensor)."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_dir():
            raise HFCheckpointError(f"HF checkpoint folder not found: {self.path}")
        config = self.path / "config.json"
        if not config.is_file():
            raise HFCheckpointError(f"{self.path} is not an HF checkpoint: no config.json")
        self.config_path = _member(self.path, "config.json", self.path)
        self.config = _read_json_object(config)
        index = self.path / INDEX
        if index.is_file():
            _member(self.path, INDEX, self.path)
            weight_map = _read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFCheckpointError(f"{index}: no weight_map object of tensor → file")
            for file in weight_map.values():
                _member(self.path, file, index)
        elif (self.path / SINGLE).is_file():
            weight_map = None
        else:
            raise HFCheckpointError(f"{self.path}: no {SINGLE} and no {INDEX}")
        # every shard's header is checked against its file when the shard is opened: here
        self.headers: dict[str, dict[str, dict]] = {}
        if weight_map is None:
            _member(self.path, SINGLE, self.path)
            self.headers[SINGLE] = _check_header(self.path / SINGLE)
            weight_map = dict.fromkeys(self.headers[SINGLE], SINGLE)
        missing_files = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
        if missing_files:
            raise HFCheckpointError(f"{self.path}: incomplete shard set, missing "
                                    f"{', '.join(missing_files)} (listed in {INDEX})")
        for file in sorted(set(weight_map.values()) - set(self.headers)):
            self.headers[file] = _check_header(self.path / file)
        for name, file in weight_map.items():
            if name not in self.headers[file]:
                raise HFCheckpointError(f"{self.path / INDEX}: tensor {name} is listed in "
                                        f"{file}, which does not hold it")
        # a VL checkpoint exposes its text model under the plain causal-LM names
        self.weight_map = {}
        for name, file in weight_map.items():
            plain = "model." + name[len(VL_TEXT_PREFIX):] if name.startswith(
                VL_TEXT_PREFIX) else name
            self.weight_map[plain] = (file, name)
        self._open = safe_open

    @property
    def architectures(self) -> list[str]:
        archs = self.config.get("architectures")
        if archs is None:
            return []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise HFCheckpointError(f"{self.config_path}: architectures {archs!r} is not a "
                                    "list of class names")
        return archs

    def model_types(self) -> set[str]:
        """`model_type` of the config and of its text part (VL checkpoints)."""
        text = self.config.get("text_config")
        found = {self.config.get("model_type"), text.get("model_type")
                 if isinstance(text, dict) else None}
        return {t for t in found if isinstance(t, str)}

    def names(self) -> list[str]:
        return list(self.weight_map)

    # Each read maps the shard and unmaps it again: a mapping kept open would hold every page
    # read so far in this process's RSS, i.e. the whole checkpoint by the end.
    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise HFCheckpointError(f"{self.path}: tensor '{name}' is missing")
        from safetensors import SafetensorError

        file, stored = self.weight_map[name]
        try:
            with self._open(self.path / file, "pt") as f:
                return f.get_tensor(stored)
        except SafetensorError as e:  # e.g. the file changed after it was checked
            raise HFCheckpointError(f"{self.path / file}: tensor {stored}: {e}") from e

    def get_slice(self, name: str, index: tuple[int | slice, ...]) -> torch.Tensor:
        """`tensor[index]` read without reading the rest (one expert of a fused tensor)."""
        if name not in self.weight_map:
            raise HFCheckpointError(f"{self.path}: tensor '{name}' is missing")
        from safetensors import SafetensorError

        file, stored = self.weight_map[name]
        try:
            with self._open(self.path / file, "pt") as f:
                return f.get_slice(stored)[index]
        except SafetensorError as e:
            raise HFCheckpointError(f"{self.path / file}: tensor {stored}: {e}") from e

    def shape(self, name: str) -> tuple[int, ...]:
        file, stored = self.weight_map[name]
        return tuple(self.headers[file][stored]["shape"])

    def _where(self, name: str) -> str:
        file, stored = self.weight_map[name]
        return f"{stored} in {file}"

    def detect_layout(self, wmap: WeightMap) -> HfLayout:
        """Per routed-expert group, from the tensor names alone: any `<group>.<digits>.…` is
        per-expert, any other `<group>.…` (`gate_up_proj`, `down_proj`) fused; both in one
        group is an error. A group with no tensors at all counts as per-expert (the check
        then names its first missing tensor)."""
        found: dict[str, tuple[list[str], list[str]]] = {
            g: ([], []) for g in wmap.expert_groups()}
        for name in self.weight_map:
            group, _, rest = name.rpartition(".mlp.experts.")
            if group and (g := f"{group}.mlp.experts") in found:
                found[g][0 if rest.split(".")[0].isdigit() else 1].append(name)
        layouts = {}
        for group, (per, fused) in found.items():
            if per and fused:
                raise HFCheckpointError(
                    f"{self.path}: routed-expert group {group} mixes per-expert tensors "
                    f"({self._where(min(per))}) with fused ones ({self._where(min(fused))}); "
                    "a group must be all per-expert or all fused")
            layouts[group] = FUSED if fused else PER_EXPERT
        return HfLayout(wmap, layouts, str(self.path))

    def check(self, wmap: WeightMap, expected_architectures: tuple[str, ...],
              model_types: tuple[str, ...] = ()) -> HfLayout:
        """Architecture, tensor set and every shape must match the registry entry, in the
        expert layout the folder uses (returned).

        A config.json without `architectures` passes only for a caller that named the model
        (`model_types`: the model_type values of that registry entry) and a config whose
        model_type is one of them."""
        archs = self.architectures
        if archs and not set(archs) & set(expected_architectures):
            raise HFCheckpointError(
                f"{self.path}: architecture {archs} does not match model "
                f"'{wmap.spec.name}' (expects {list(expected_architectures)})")
        if not archs:
            found = sorted(self.model_types())
            if not model_types:
                raise HFCheckpointError(f"{self.config_path}: no 'architectures' list, so the "
                                        "model family is unknown")
            if not set(found) & set(model_types):
                raise HFCheckpointError(
                    f"{self.config_path}: no 'architectures' list, and model_type "
                    f"{found or 'missing'} does not confirm model '{wmap.spec.name}' "
                    f"(expects architectures {list(expected_architectures)} or model_type "
                    f"{list(model_types)})")
        layout = self.detect_layout(wmap)
        expected = layout.file_shapes()
        skipped = ("model.visual",) + (() if wmap.spec.mtp_num_layers else ("mtp.",))
        have = {n for n in self.weight_map if not n.startswith(skipped)}
        if wmap.spec.tie_word_embeddings:
            have.discard("lm_head.weight")
        missing = sorted(set(expected) - have)
        extra = sorted(have - set(expected))
        if missing:
            group = next((g for g in layout.groups if missing[0].startswith(g + ".")), None)
            hint = (f"; routed-expert group {group} has no tensors at all (neither "
                    f"per-expert nor fused {group}.gate_up_proj)"
                    if group and not any(n.startswith(group + ".") for n in have) else "")
            raise HFCheckpointError(f"{self.path}: missing tensor {missing[0]}"
                                    + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
                                    + hint)
        if extra:
            raise HFCheckpointError(f"{self.path}: unexpected tensor {extra[0]} for model "
                                    f"'{wmap.spec.name}'"
                                    + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""))
        for name, shape in expected.items():
            found = self.shape(name)
            if found != shape:
                raise HFCheckpointError(f"{self.path}: tensor {name} has shape {list(found)}, "
                                        f"expected {list(shape)} for model '{wmap.spec.name}' "
                                        f"(in {self.weight_map[name][0]})")
        return layout


class ShardedSafetensorsWriter:
    """Writes tensors into ~`max_shard_bytes` safetensors files as they arrive, then the index.

    Memory is bounded by one shard. Files are written inside `folder` (a temp dir the caller
    renames when everything, including config and tokenizer, is in place).
    """

    def __init__(self, folder: Path, max_shard_bytes: int = 2 << 30, prefix: str | None = None):
        """`prefix`: one of several writers into the same folder: its files are named
        `<prefix>model-….safetensors` and no index is written (a loader reads every file)."""
        self.folder = folder
        self.max = max_shard_bytes
        self.prefix = prefix
        self._buffer: dict[str, torch.Tensor] = {}
        self._bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._buffer and self._bytes + size > self.max:
            self._flush()
        self._buffer[name] = tensor.detach().contiguous().clone()
        self._bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        name = f"{self.prefix or ''}part-{len(self._shards):05d}.safetensors"
        save_file(self._buffer, str(self.folder / name), metadata={"format": "pt"})
        self._shards.append((name, list(self._buffer)))
        self._buffer, self._bytes = {}, 0

    def close(self) -> list[str]:
        if self._buffer:
            self._flush()
        n = len(self._shards)
        weight_map, files = {}, []
        for i, (tmp_name, names) in enumerate(self._shards):
            final = SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            if self.prefix is not None:
                final = f"{self.prefix}{final}"
            os.replace(self.folder / tmp_name, self.folder / final)
            files.append(final)
            weight_map.update(dict.fromkeys(names, final))
        if n > 1 and self.prefix is None:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
        return files


def copy_tokenizer(source: Path | None, target: Path) -> list[str]:
    if source is None:
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
            copied.append(name)
    return copied
