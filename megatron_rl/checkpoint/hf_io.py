"""Hugging Face checkpoints on disk: a validating lazy reader and a streaming shard writer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from megatron_rl.checkpoint.errors import HFCheckpointError
from megatron_rl.checkpoint.weight_map import WeightMap

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")
# VL checkpoints (e.g. Qwen3.5) keep the text model under this prefix
VL_TEXT_PREFIX = "model.language_model."


class HFCheckpoint:
    """Reads tensors one at a time (memory ~ one tensor), checking the folder up front."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_dir():
            raise HFCheckpointError(f"HF checkpoint folder not found: {self.path}")
        config = self.path / "config.json"
        if not config.is_file():
            raise HFCheckpointError(f"{self.path} is not an HF checkpoint: no config.json")
        self.config = json.loads(config.read_text())
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            weight_map = None
        else:
            raise HFCheckpointError(f"{self.path}: no {SINGLE} and no {INDEX}")
        if weight_map is None:
            with safe_open(self.path / SINGLE, "pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE)
        missing_files = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
        if missing_files:
            raise HFCheckpointError(f"{self.path}: incomplete shard set, missing "
                                    f"{', '.join(missing_files)} (listed in {INDEX})")
        # a VL checkpoint exposes its text model under the plain causal-LM names
        self.weight_map = {}
        for name, file in weight_map.items():
            plain = "model." + name[len(VL_TEXT_PREFIX):] if name.startswith(
                VL_TEXT_PREFIX) else name
            self.weight_map[plain] = (file, name)
        self._open = safe_open

    @property
    def architectures(self) -> list[str]:
        return list(self.config.get("architectures") or [])

    def names(self) -> list[str]:
        return list(self.weight_map)

    # Each read maps the shard and unmaps it again: a mapping kept open would hold every page
    # read so far in this process's RSS, i.e. the whole checkpoint by the end.
    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise HFCheckpointError(f"{self.path}: tensor '{name}' is missing")
        file, stored = self.weight_map[name]
        with self._open(self.path / file, "pt") as f:
            return f.get_tensor(stored)

    def shape(self, name: str) -> tuple[int, ...]:
        file, stored = self.weight_map[name]
        with self._open(self.path / file, "pt") as f:
            return tuple(f.get_slice(stored).get_shape())

    def check(self, wmap: WeightMap, expected_architectures: tuple[str, ...]) -> None:
        """Architecture, tensor set and every shape must match the registry entry."""
        archs = self.architectures
        if archs and not set(archs) & set(expected_architectures):
            raise HFCheckpointError(
                f"{self.path}: architecture {archs} does not match model "
                f"'{wmap.spec.name}' (expects {list(expected_architectures)})")
        expected = wmap.hf_shapes()
        skipped = ("model.visual",) + (() if wmap.spec.mtp_num_layers else ("mtp.",))
        have = {n for n in self.weight_map if not n.startswith(skipped)}
        if wmap.spec.tie_word_embeddings:
            have.discard("lm_head.weight")
        missing = sorted(set(expected) - have)
        extra = sorted(have - set(expected))
        if missing:
            raise HFCheckpointError(f"{self.path}: missing tensor {missing[0]}"
                                    + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
        if extra:
            raise HFCheckpointError(f"{self.path}: unexpected tensor {extra[0]} for model "
                                    f"'{wmap.spec.name}'"
                                    + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""))
        for name, shape in expected.items():
            found = self.shape(name)
            if found != shape:
                raise HFCheckpointError(f"{self.path}: tensor {name} has shape {list(found)}, "
                                        f"expected {list(shape)} for model '{wmap.spec.name}'")


class ShardedSafetensorsWriter:
    """Writes tensors into ~`max_shard_bytes` safetensors files as they arrive, then the index.

    Memory is bounded by one shard. Files are written inside `folder` (a temp dir the caller
    renames when everything, including config and tokenizer, is in place).
    """

    def __init__(self, folder: Path, max_shard_bytes: int = 2 << 30):
        self.folder = folder
        self.max = max_shard_bytes
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

        name = f"part-{len(self._shards):05d}.safetensors"
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
            os.replace(self.folder / tmp_name, self.folder / final)
            files.append(final)
            weight_map.update(dict.fromkeys(names, final))
        if n > 1:
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
