"""HF ⇄ Megatron conversion, GPU-free.

* `import_hf` (one process, no model) streams an HF folder into a model-only torch_dist
  checkpoint, one tensor in memory at a time; megatron reshards it to any layout on load.
* `export_hf` (one process) streams a torch_dist checkpoint layer by layer into safetensors
  shards + index + config + generation config + tokenizer files, in a temp folder it renames.

Routed experts may be stored per expert or fused, per group (`HfLayout`). The import detects
the layout and records it in the checkpoint's manifest (`hf_layout`); training checkpoints
carry it on (`load_checkpoint` → `save_checkpoint`), and the export writes it back, so a
folder round-trips to its own keys. A checkpoint without one exports per-expert.
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from megatron_rl.checkpoint.errors import WeightMapError
from megatron_rl.checkpoint.hf_io import HFCheckpoint, ShardedSafetensorsWriter, copy_tokenizer
from megatron_rl.checkpoint.weight_map import EXPERT_LAYOUTS, HfLayout, WeightMap
from megatron_rl.models.registry import HF_CLASSES, HF_MODEL_TYPES, ModelSpec


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def import_hf(hf_dir: str, out_dir: str, model_name: str | ModelSpec, dtype: str = "fp32",
              progress: bool = True) -> dict[str, Any]:
    """HF folder → model-only torch_dist checkpoint, one tensor in memory at a time.

    No model is built and no process group is needed: the weight map gives every Megatron
    checkpoint key and its canonical shape, and torch.distributed.checkpoint writes one chunk
    per (key, layer[, expert]), asking for each chunk's data only when it writes it. Megatron
    reshards such a checkpoint to any TP/PP/EP layout on load."""
    from megatron_rl.models import cpu_compat

    cpu_compat.import_megatron()
    import megatron.core.dist_checkpointing as mcore_ckpt  # noqa: F401 (registers strategies)
    from torch.distributed.checkpoint import FileSystemWriter, save

    from megatron_rl.checkpoint.training_checkpoint import write_sharded
    from megatron_rl.models.registry import get_model_spec

    t0 = time.time()
    spec = model_name if isinstance(model_name, ModelSpec) else get_model_spec(model_name)
    wmap = WeightMap(spec)
    hf = HFCheckpoint(hf_dir)
    layout = hf.check(wmap, (HF_CLASSES[spec.architecture][1], *_vl_names(spec)),
                      _model_types(spec))
    out_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    planner = _StreamingImportPlanner(wmap, hf, layout, out_dtype, progress)

    def write(folder: Path) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            save({}, storage_writer=FileSystemWriter(str(folder), thread_count=1),
                 planner=planner, no_dist=True)
        except CheckpointException as e:  # DCP wraps the reader's error: surface it
            cause = next(iter(e.failures.values()), (None, None))[0]  # (exception, trace)
            if isinstance(cause, BaseException):
                raise cause from e
            raise
        (folder / "metadata.json").write_text(
            json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))

    out = Path(out_dir)
    info = {"step": 0, "model": spec.name, "contents": ["model"], "source": str(hf_dir),
            "layout": {"world": 1, "tp": 1, "pp": 1, "ep": 1, "etp": 1, "cp": 1, "dp": 1,
                       "distributed_optimizer": 0},
            "hf_layout": layout.to_json()}
    write_sharded(None, out.parent, out.name, info, update_latest=False, save=write)
    planner.bar.close()
    seconds = time.time() - t0
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return {"tensors": planner.written, "bytes": size, "seconds": seconds,
            "mb_per_s": size / 1e6 / max(seconds, 1e-9), "peak_rss_mb": _peak_rss_mb(),
            "hf_layout": layout.to_json()}


COMMON_STATE = "common_state/shard_0_1"  # megatron's ShardedObject("common_state").unique_key


class _StreamingImportPlanner:
    """A torch.distributed.checkpoint SavePlanner whose items are (key, layer[, expert])
    chunks computed from the HF folder on demand (`resolve_data`), never all at once."""

    def __init__(self, wmap: WeightMap, hf: HFCheckpoint, layout: HfLayout, dtype: torch.dtype,
                 progress: bool):
        from tqdm import tqdm

        self.wmap, self.hf, self.layout, self.dtype = wmap, hf, layout, dtype
        # (key, chunk offsets) → (entry, logical index, position in entry.keys, chunk size)
        self.chunks: dict[tuple[str, tuple[int, ...]], tuple[Any, tuple[int, ...], int,
                                                            tuple[int, ...]]] = {}
        self.sizes: dict[str, tuple[int, ...]] = {}
        for entry, index in wmap.units():
            shapes = wmap.megatron_shapes(entry, index)
            lead = self._leading(entry, index)
            for position, key in enumerate(wmap.checkpoint_keys(entry, index)):
                shape = tuple(shapes[position])
                offsets = (*lead, *(0,) * len(shape))
                self.chunks[(key, offsets)] = (entry, index, position, (1,) * len(lead) + shape)
                self.sizes[key] = self._global_size(entry, shape)
        self.cache_key, self.cache = None, []
        self.written = 0
        self.bar = tqdm(total=len(self.chunks), desc="import", unit="tensor", disable=not progress,
                        file=sys.stderr)

    def _leading(self, entry, index: tuple[int, ...]) -> tuple[int, ...]:
        """Offsets on the stacked axes: (layer,) when layers are stacked, then (expert,)."""
        lead = index[:1] if self.wmap.has_layer_axis(entry) else ()
        return lead + (index[1:] if entry.stack == 2 else ())

    def _global_size(self, entry, shape: torch.Size) -> tuple[int, ...]:
        spec = self.wmap.spec
        lead = (spec.num_layers,) if self.wmap.has_layer_axis(entry) else ()
        lead += (spec.num_experts,) if entry.stack == 2 else ()
        return (*lead, *shape)

    # -- SavePlanner protocol ------------------------------------------------------------------
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = True) -> None:
        pass

    def create_local_plan(self):
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import (
            SavePlan,
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        items = [WriteItem(
            index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(chunk)),
                properties=TensorProperties(dtype=self.dtype), size=torch.Size(self.sizes[key])))
            for (key, offsets), (*_, chunk) in self.chunks.items()]
        # megatron's (empty) common state, stored as its torch_dist writer stores it
        items.append(WriteItem(index=MetadataIndex(COMMON_STATE), type=WriteItemType.BYTE_IO))
        return SavePlan(items)

    def create_global_plan(self, plans):
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        plans, metadata = create_default_global_save_plan(plans, rewrite_index_hints=False)
        self.metadata = metadata
        return plans, metadata

    def finish_plan(self, plan):
        return plan

    def resolve_data(self, item) -> torch.Tensor | io.BytesIO:
        if item.index.fqn == COMMON_STATE:
            buffer = io.BytesIO()
            torch.save([{}], buffer)  # as megatron writes it: a one-item list
            buffer.seek(0)
            return buffer
        key, offsets = item.index.fqn, tuple(item.index.offset)
        entry, index, position, chunk = self.chunks[(key, offsets)]
        if (entry.keys, index) != self.cache_key:  # GDN sections / q,k,v share one HF read
            self.cache = self.wmap.to_megatron(entry, index, self._read)
            self.cache_key = (entry.keys, index)
        tensor = self.cache[position].to(self.dtype).contiguous()
        self.written += 1
        self.bar.update(1)
        return tensor.reshape(chunk)

    def _read(self, name: str) -> torch.Tensor:
        """An HF tensor by its per-expert name; in a fused group just that expert's slice."""
        fused = self.layout.source(name)
        return self.hf.get(name) if fused is None else self.hf.get_slice(*fused)


def _vl_names(spec: ModelSpec) -> tuple[str, ...]:
    return ("Qwen3_5MoeForConditionalGeneration",) if spec.architecture == "qwen3_5_moe" else ()


def _model_types(spec: ModelSpec) -> tuple[str, ...]:
    """config.json `model_type` values of the registry entry's family (text model, VL)."""
    text = HF_MODEL_TYPES[spec.architecture]
    return (text, "qwen3_5_moe") if spec.architecture == "qwen3_5_moe" else (text,)


def export_hf(ckpt_dir: str, out_dir: str, model_name: str | ModelSpec,
              tokenizer_dir: str | None = None,
              dtype: str | None = None, max_shard_bytes: int = 2 << 30,
              overwrite: bool = False, progress: bool = True,
              hf_layout: str | Mapping[str, str] | None = None) -> dict[str, Any]:
    """torch_dist checkpoint → HF folder, one layer in memory at a time. One process, no
    process group: the checkpoint is read with torch.distributed.checkpoint directly.

    Routed experts are written in `hf_layout`: 'per_expert' or 'fused' for every group, or a
    table group → layout; by default the one the checkpoint's manifest records (the HF source
    the weights were imported from), else per-expert."""
    from tqdm import tqdm
    from transformers import GenerationConfig

    from megatron_rl.checkpoint.training_checkpoint import resolve_checkpoint, verify_checkpoint
    from megatron_rl.models.registry import get_model_spec

    t0 = time.time()
    spec = model_name if isinstance(model_name, ModelSpec) else get_model_spec(model_name)
    wmap = WeightMap(spec)
    src = resolve_checkpoint(ckpt_dir)
    manifest = verify_checkpoint(src, collective=False)  # one process exports
    if manifest.get("model") not in (None, spec.name):
        raise WeightMapError(f"{src} holds model '{manifest['model']}', not '{spec.name}'")
    layout = _export_layout(wmap, hf_layout, manifest, src)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite to replace it)")
    metadata = read_metadata(src)
    model_keys = {k for k in metadata if "_extra_state" not in k
                  and k.startswith(("embedding.", "decoder.", "mtp.", "output_layer."))}
    expected = wmap.all_checkpoint_keys()
    unknown = sorted(model_keys - expected)
    if unknown:
        raise WeightMapError(f"{src}: tensor '{unknown[0]}' is not in the weight map of "
                             f"'{spec.name}'")
    absent = sorted(expected - model_keys)
    if absent:
        raise WeightMapError(f"{src}: tensor '{absent[0]}' is missing from the checkpoint")
    out_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[dtype]

    tmp = out.parent / f".tmp-{out.name}"  # only once the checkpoint's metadata is known good
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
    units = list(wmap.units())
    bar = tqdm(total=len(units), desc="export", unit="tensor", disable=not progress,
               file=sys.stderr)
    # one read per layer (all its keys; routed experts come as one [experts, ...] block)
    groups: dict[Any, list] = {}
    for entry, index in units:
        groups.setdefault((entry.layer_type == "mtp", index[0]) if index else entry.keys,
                          []).append((entry, index))
    for group in groups.values():
        regions = {}
        for entry, index in group:
            layer_axis = wmap.has_layer_axis(entry)
            for key in wmap.checkpoint_keys(entry, index):
                shape = tuple(metadata[key].size)
                if layer_axis:  # this layer only
                    regions[key] = ((index[0],) + (0,) * (len(shape) - 1), (1, *shape[1:]))
                else:
                    regions[key] = ((0,) * len(shape), shape)
        loaded = read_regions(src, regions, metadata)
        layer: dict[str, torch.Tensor] = {}
        for entry, index in group:
            layer_axis = wmap.has_layer_axis(entry)
            tensors = []
            for key in wmap.checkpoint_keys(entry, index):
                tensor = loaded[key][0] if layer_axis else loaded[key]
                if entry.stack == 2:
                    tensor = tensor[index[1]]  # this expert
                if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    tensor = tensor[: spec.vocab_size]  # drop TP vocab padding
                tensors.append(tensor)
            layer.update(wmap.to_hf(entry, index, tensors))
            bar.update(1)
        for name, t in layout.pack(layer).items():  # fused groups: a whole layer's experts
            writer.add(name, t.to(out_dtype) if out_dtype else t)
    bar.close()
    files = writer.close()

    torch_dtype = out_dtype or metadata["embedding.word_embeddings.weight"].properties.dtype
    config = spec.hf_config(torch_dtype=str(torch_dtype).removeprefix("torch."))
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    tokenizer = copy_tokenizer(Path(tokenizer_dir) if tokenizer_dir else None, tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    seconds = time.time() - t0
    return {"files": files, "tokenizer_files": tokenizer, "bytes": writer.total_bytes,
            "seconds": seconds, "mb_per_s": writer.total_bytes / 1e6 / max(seconds, 1e-9),
            "peak_rss_mb": _peak_rss_mb(), "tensors": len(layout.file_shapes()),
            "hf_layout": layout.to_json()}


def _export_layout(wmap: WeightMap, asked: str | Mapping[str, str] | None,
                   manifest: dict[str, Any], src: Path) -> HfLayout:
    if isinstance(asked, str):
        if asked not in EXPERT_LAYOUTS:
            raise WeightMapError(f"hf_layout={asked!r}: choose one of {', '.join(EXPERT_LAYOUTS)}")
        return HfLayout.uniform(wmap, asked)
    if asked is not None:
        return HfLayout(wmap, asked, "hf_layout")
    if "hf_layout" in manifest:
        return HfLayout.from_json(wmap, manifest["hf_layout"], f"{src / 'manifest.json'}")
    return HfLayout.uniform(wmap)


def read_metadata(folder: Path) -> dict[str, Any]:
    """Key → TensorStorageMetadata (global size, dtype) of a torch_dist checkpoint."""
    from megatron_rl.checkpoint.safe_io import SafeFileSystemReader

    return SafeFileSystemReader(str(folder)).read_metadata().state_dict_metadata


def read_regions(folder: Path, regions: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
                 metadata: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Read only `regions` (key → (offsets, sizes)) of a torch_dist checkpoint."""
    import warnings

    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_rl.checkpoint.safe_io import SafeFileSystemReader, unwrap_dcp_error

    buffers = {k: torch.empty(sizes, dtype=metadata[k].properties.dtype)
               for k, (_, sizes) in regions.items()}
    with warnings.catch_warnings():  # "assuming single process" is exactly the intent
        warnings.simplefilter("ignore")
        try:
            load(buffers, storage_reader=SafeFileSystemReader(str(folder)),
                 planner=_region_planner(regions), no_dist=True)
        except CheckpointException as e:  # DCP wraps the reader's error: surface ours
            cause = unwrap_dcp_error(e)
            if cause is e:
                raise
            raise cause from e
    return buffers


def _region_planner_cls():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RegionPlanner(DefaultLoadPlanner):
        """Reads a sub-block of each stored tensor instead of the whole tensor."""

        def __init__(self, regions):
            super().__init__()
            self.regions = regions

        def create_local_plan(self) -> LoadPlan:
            items = []
            for fqn in self.state_dict:
                offsets, sizes = self.regions[fqn]
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                items += create_read_items_for_chunk_list(
                    fqn, self.metadata.state_dict_metadata[fqn], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn]

    return RegionPlanner


def _region_planner(regions):
    return _region_planner_cls()(regions)

