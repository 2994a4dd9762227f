"""HF ⇄ Megatron conversion, GPU-free.

* `load_hf_weights` fills a live Megatron model (any TP/PP/EP layout) from an HF folder: every
  rank reads only the HF tensors behind its own shards, one at a time.
* `import_hf` (SPMD, every rank) = build the model at a layout, `load_hf_weights`, save a
  model-only torch_dist checkpoint that loads at any other layout.
* `export_hf` (one process) streams a torch_dist checkpoint layer by layer into safetensors
  shards + index + config + generation config + tokenizer files, in a temp folder it renames.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from megatron_rl.checkpoint.errors import HFCheckpointError, WeightMapError
from megatron_rl.checkpoint.hf_io import HFCheckpoint, ShardedSafetensorsWriter, copy_tokenizer
from megatron_rl.checkpoint.weight_map import WeightMap
from megatron_rl.models.registry import HF_CLASSES, ModelSpec


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _model_tensors(sharded: dict[str, Any]) -> list:
    """The ShardedTensors of a model's sharded state dict, swiglu factories expanded."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for v in nested_values(sharded):
        if isinstance(v, ShardedTensorFactory):
            out += [t for t in nested_values(v.build()) if isinstance(t, ShardedTensor)]
        elif isinstance(v, ShardedTensor):
            out.append(v)
    return out


@torch.no_grad()
def load_hf_weights(module: torch.nn.Module, hf: HFCheckpoint, wmap: WeightMap) -> int:
    """Copy HF weights into this rank's shards of `module`; returns the tensors filled.

    Megatron's sharding metadata says which (layer, expert) and which TP slice each local
    parameter holds; the weight map supplies the canonical tensor, the metadata cuts it.
    """
    filled, cache_key, canonical = 0, None, []
    for sh in _model_tensors(module.sharded_state_dict()):
        stack = sh.prepend_axis_num
        entry, index, position = wmap.locate(sh.key, tuple(sh.global_offset[:stack]))
        if (entry.keys, index) != cache_key:  # swiglu halves / GDN sections share one read
            canonical = wmap.to_megatron(entry, index, hf.get)
            cache_key = (entry.keys, index)
        full_shape = tuple(sh.global_shape[stack:])
        source = canonical[position]
        if source.shape != full_shape:
            if not sh.allow_shape_mismatch:
                raise HFCheckpointError(f"{sh.key}{list(index)}: HF gives {list(source.shape)}, "
                                        f"the model needs {list(full_shape)}")
            padded = torch.zeros(full_shape, dtype=source.dtype)  # vocab padding rows
            padded[: source.shape[0]] = source
            source = padded
        cut = tuple(slice(o, o + n) for o, n in zip(sh.global_offset[stack:], sh.local_shape,
                                                    strict=True))
        sh.data.copy_(source[cut])
        filled += 1
    return filled


def import_hf(hf_dir: str, out_dir: str, model_name: str, parallel_overrides: list[str],
              dtype: str = "fp32") -> dict[str, Any]:
    """SPMD job body: HF folder → model-only torch_dist checkpoint at `out_dir`."""
    import torch.distributed as dist

    from megatron_rl.checkpoint.training_checkpoint import layout_info, write_sharded
    from megatron_rl.config.loader import load_config
    from megatron_rl.distributed.process_groups import init_model_parallel
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.registry import get_model_spec

    t0 = time.time()
    cfg = load_config(None, [f"model.name={model_name}", f"model.dtype={dtype}",
                             *parallel_overrides])
    spec = get_model_spec(model_name)
    wmap = WeightMap(spec)
    hf = HFCheckpoint(hf_dir)
    hf.check(wmap, (HF_CLASSES[spec.architecture][1], *_vl_names(spec)))
    layout = init_model_parallel(cfg.parallel, cfg.train.seed)
    # every weight is overwritten from HF: skip random init (time, and its full-size temporaries)
    module = build_gpt_model(spec, cfg.model, cfg.parallel, perform_initialization=False)
    filled = load_hf_weights(module, hf, wmap)
    out = Path(out_dir)
    info = {"step": 0, "model": spec.name, "contents": ["model"], "source": str(hf_dir),
            "layout": layout_info(cfg.parallel, layout)}
    write_sharded({"model": module.sharded_state_dict()}, out.parent, out.name, info,
                  update_latest=False)
    return {"rank": dist.get_rank(), "tensors": filled, "seconds": time.time() - t0,
            "peak_rss_mb": _peak_rss_mb()}


def _vl_names(spec: ModelSpec) -> tuple[str, ...]:
    return ("Qwen3_5MoeForConditionalGeneration",) if spec.architecture == "qwen3_5_moe" else ()


def export_hf(ckpt_dir: str, out_dir: str, model_name: str, tokenizer_dir: str | None = None,
              dtype: str | None = None, max_shard_bytes: int = 2 << 30,
              overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
    """torch_dist checkpoint → HF folder, one layer in memory at a time. One process, no
    process group: the checkpoint is read with torch.distributed.checkpoint directly."""
    from tqdm import tqdm
    from transformers import GenerationConfig

    from megatron_rl.checkpoint.training_checkpoint import resolve_checkpoint, verify_checkpoint
    from megatron_rl.models.registry import get_model_spec

    t0 = time.time()
    spec = get_model_spec(model_name)
    wmap = WeightMap(spec)
    src = resolve_checkpoint(ckpt_dir)
    manifest = verify_checkpoint(src)
    if manifest.get("model") not in (None, spec.name):
        raise WeightMapError(f"{src} holds model '{manifest['model']}', not '{spec.name}'")
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite to replace it)")
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

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

    writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
    units = list(wmap.units())
    bar = tqdm(total=len(units), desc="export", unit="tensor", disable=not progress,
               file=sys.stderr)
    # one read per layer (all its keys; routed experts come as one [experts, ...] block)
    groups: dict[Any, list] = {}
    for entry, index in units:
        groups.setdefault(index[:1] if index else entry.keys, []).append((entry, index))
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
            for name, t in wmap.to_hf(entry, index, tensors).items():
                writer.add(name, t.to(out_dtype) if out_dtype else t)
            bar.update(1)
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
            "peak_rss_mb": _peak_rss_mb(), "tensors": len(wmap.hf_names())}


def read_metadata(folder: Path) -> dict[str, Any]:
    """Key → TensorStorageMetadata (global size, dtype) of a torch_dist checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(folder)).read_metadata().state_dict_metadata


def read_regions(folder: Path, regions: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
                 metadata: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Read only `regions` (key → (offsets, sizes)) of a torch_dist checkpoint."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader, load

    buffers = {k: torch.empty(sizes, dtype=metadata[k].properties.dtype)
               for k, (_, sizes) in regions.items()}
    with warnings.catch_warnings():  # "assuming single process" is exactly the intent
        warnings.simplefilter("ignore")
        load(buffers, storage_reader=FileSystemReader(str(folder)),
             planner=_region_planner(regions), no_dist=True)
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

