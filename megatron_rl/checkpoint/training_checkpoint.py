"""Training checkpoints: torch_dist (reshardable), atomic, verified on load.

Layout of a run's checkpoint folder:
    <dir>/step_000012/        megatron dist_checkpointing files + manifest.json
    <dir>/latest              "step_000012"
A save writes `<dir>/.tmp-step_000012/`, checksums every file into manifest.json, then renames
the folder; a folder without a manifest is never loaded. Holds model, optimizer, LR schedule,
per-rank RNG states, step and any caller progress (e.g. the data cursor). The manifest also
carries `hf_layout`, the expert layout of the HF folder the weights were imported from: loading
a checkpoint keeps it on the actor and its saves write it on, so an export writes that layout.

A checkpoint folder is untrusted input: it must hold exactly the files its manifest lists, and
it is read through `safe_io` (no pickled object beyond plain data is ever built).
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import shutil
import stat
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.checkpoint.errors import CheckpointError

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT_VERSION = 1


# -- integrity ---------------------------------------------------------------------------------
def _crc32(path: Path, chunk: int = 1 << 22) -> str:
    crc = 0
    with path.open("rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _split_work(files: list[str]) -> list[str]:
    """Each rank checksums a disjoint slice of the files; results are all-gathered."""
    if not dist.is_initialized():
        return files
    return files[dist.get_rank()::dist.get_world_size()]


def _gather_dict(local: dict[str, Any]) -> dict[str, Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    parts: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def _files(folder: Path) -> list[str]:
    """Every file of `folder` but the manifest (relative names, sorted)."""
    return sorted(_entries(folder)[0])


def _entries(folder: Path) -> tuple[list[str], list[str]]:
    """(regular files but the manifest, problems): a checkpoint holds regular files only, so a
    symlink or a device is reported, not followed."""
    files, problems = [], []
    for root, dirs, names in os.walk(folder):
        for name in [*dirs, *names]:
            path = Path(root) / name
            rel = str(path.relative_to(folder))
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                problems.append(f"{rel}: a symbolic link (checkpoints hold regular files only)")
            elif stat.S_ISREG(mode):
                if rel != MANIFEST:
                    files.append(rel)
            elif not stat.S_ISDIR(mode):
                problems.append(f"{rel}: not a regular file")
    return files, problems


def _write_manifest(folder: Path, info: dict[str, Any]) -> None:
    names = _files(folder)
    local = {n: {"bytes": (folder / n).stat().st_size, "crc32": _crc32(folder / n)}
             for n in _split_work(names)}
    entries = _gather_dict(local)
    if _rank() == 0:
        manifest = {"format_version": FORMAT_VERSION, "files": entries, **info}
        _atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


REQUIRED_KEYS = ("format_version", "files", "step", "model", "layout", "contents")


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest, checked for shape: a JSON object with every required key and a non-empty
    `files` table of name -> {bytes, crc32}, each name a path inside the folder."""
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except RecursionError:
        raise CheckpointError(f"{path}: unreadable manifest (JSON nested too deeply)") from None
    except ValueError as e:  # not UTF-8, not JSON, an integer past the digit limit
        raise CheckpointError(f"{path}: unreadable manifest ({str(e).split(';')[0]})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: unreadable manifest (not a JSON object)")
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise CheckpointError(f"{path}: manifest lacks {', '.join(missing)}")
    if type(manifest["format_version"]) is not int or manifest["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path}: manifest format {manifest['format_version']!r}, "
                              f"expected {FORMAT_VERSION}")
    files = manifest["files"]
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{path}: the manifest lists no files")
    for name, meta in files.items():
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or name == MANIFEST:
            raise CheckpointError(f"{path}: manifest entry {name!r} is not a file of the "
                                  "checkpoint folder")
        if (not isinstance(meta, dict) or type(meta.get("bytes")) is not int
                or meta["bytes"] < 0 or not isinstance(meta.get("crc32"), str)
                or not re.fullmatch(r"[0-9a-f]{8}", meta["crc32"])):
            raise CheckpointError(f"{path}: manifest entry for {name} is not "
                                  "{bytes: int, crc32: 8 hex digits}")
    return manifest


def verify_checkpoint(folder: Path, mode: str = "crc32", collective: bool = True
                      ) -> dict[str, Any]:
    """Check that the folder holds exactly the manifest's files, each intact; return the
    manifest. Problems name the file. `collective`: every rank checksums a share (all ranks
    must call it); False: this process checks everything alone (one rank exporting)."""
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder not found: {folder}")
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        hint = (" (it has megatron files, so the save was interrupted)"
                if (folder / "metadata.json").exists() else " (not a checkpoint folder)")
        raise CheckpointError(f"{folder}: no {MANIFEST}{hint}")
    manifest = _read_manifest(manifest_path)
    files = manifest["files"]
    present, problems = _entries(folder)
    problems += [f"{name}: not listed in the manifest" for name in present if name not in files]
    have = set(present)
    for name, meta in files.items():
        path = folder / name
        if name not in have:
            if not path.is_symlink():  # a symlink is reported by _entries already
                problems.append(f"{name}: missing")
        elif path.stat().st_size != meta["bytes"]:
            problems.append(f"{name}: {path.stat().st_size} bytes, expected {meta['bytes']} "
                            "(truncated?)")
    if mode == "crc32" and not problems:
        names = _split_work(sorted(files)) if collective else sorted(files)
        local = {n: _crc32(folder / n) for n in names}
        for name, crc in sorted((_gather_dict(local) if collective else local).items()):
            if crc != files[name]["crc32"]:
                problems.append(f"{name}: crc32 {crc}, expected {files[name]['crc32']} (corrupt)")
    if problems:
        raise CheckpointError(f"checkpoint {folder} is damaged: " + "; ".join(problems))
    return manifest


# -- helpers -----------------------------------------------------------------------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve_checkpoint(path: str | Path) -> Path:
    """A step folder, or a run folder whose `latest` names one."""
    path = Path(path)
    if (path / LATEST).is_file():
        return path / (path / LATEST).read_text().strip()
    return path


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    return root / (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def layout_info(parallel, layout) -> dict[str, int]:
    """The parallel layout a checkpoint was written at (RNG streams only fit the same one)."""
    p = parallel
    return {"world": layout.world_size, "tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.etp,
            "cp": p.cp, "dp": layout.dp, "distributed_optimizer": int(p.distributed_optimizer)}


def _layout(actor) -> dict[str, int]:
    return layout_info(actor.cfg.parallel, actor.layout)


OPTIMIZER_METADATA = {
    # canonical per-parameter state: reshardable across TP/PP/EP/DP and with/without distopt
    "distrib_optim_sharding_type": "fully_reshardable",
    # sharded keys that do not depend on how megatron chains its sub-optimizers
    "chained_optim_avoid_prefix": True,
}


def _split_sharded(tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return extract_matching_values(tree, lambda v: isinstance(v, ShardedBase))


def _restore_step(tree: Any, step: int) -> None:
    """Write Adam's step counter into a loaded optimizer state, wherever megatron expects it:
    per parameter (next to its moments) and, for the CPU distributed optimizer, per group."""
    if isinstance(tree, list):
        for x in tree:
            _restore_step(x, step)
        return
    if not isinstance(tree, dict):
        return
    if "exp_avg" in tree:
        tree["step"] = torch.tensor(float(step))
        return
    for group in tree.get("param_groups", []):
        if isinstance(group, dict) and "step" in group:
            group["step"] = step
    for v in tree.values():
        _restore_step(v, step)


def _optimizer_state(actor, model_sd: dict[str, Any], loading: bool
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(sharded part, layout-specific common part) of the optimizer state.

    Megatron chains one sub-optimizer per distinct (dense, expert) DP group, so the *common*
    part (step counter, param groups) is shaped by the layout. Only the sharded part (Adam
    moments, main params) is saved; the common part comes from the live optimizer on load,
    with the saved step counter written back in.
    """
    if loading and actor.cfg.parallel.distributed_optimizer:
        # CPU builds (no Apex/TE) read the step from existing Adam state; create it first
        for sub in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
            sub._init_optimizer_states_with_dummy_values()
    osd = actor.optimizer.sharded_state_dict(model_sd, is_loading=loading,
                                             metadata=OPTIMIZER_METADATA)
    return _split_sharded(osd)


def _sharded_state(actor, *, rng: bool) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state: dict[str, Any] = {"model": actor.model[0].module.sharded_state_dict()}
    if rng:
        world, rank = dist.get_world_size(), dist.get_rank()
        state["rng"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    return state


# -- save / load -------------------------------------------------------------------------------
def save_checkpoint(actor, root: str | Path, progress: dict[str, Any] | None = None,
                    keep_last: int | None = None) -> Path:
    """Collective: every rank calls it. Returns the final step folder."""
    state = _sharded_state(actor, rng=True)
    contents = ["model", "scheduler", "rng", "progress"]
    if actor.optimizer_steps:  # before its first step Adam has no moments to save
        state["optimizer"], _layout_specific = _optimizer_state(actor, state["model"],
                                                                loading=False)
        contents.insert(1, "optimizer")
    state["optimizer_step"] = actor.optimizer_steps
    state["scheduler"] = actor.scheduler.state_dict()
    state["progress"] = {"step": actor.step, **(progress or {})}
    state["layout"] = _layout(actor)
    info = {"step": actor.step, "layout": _layout(actor), "model": actor.spec.name,
            "contents": contents}
    hf_layout = getattr(actor, "hf_layout", None)
    if hf_layout is not None:  # the HF expert layout of the weights' source, for export
        info["hf_layout"] = hf_layout
    return write_sharded(state, Path(root), f"step_{actor.step:06d}", info, keep_last)


def _in_process_write_results() -> None:
    """megatron's file writer returns its results through a multiprocessing Manager queue that
    it creates on first use by spawning a Python process (~5 s on every rank's first save). A
    synchronous save runs the writer in this process, where a plain queue does the same."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


def write_sharded(state: dict[str, Any] | None, root: Path, name: str, info: dict[str, Any],
                  keep_last: int | None = None, update_latest: bool = True,
                  save: Callable[[Path], None] | None = None) -> Path:
    """Save a sharded state dict as `root/name` atomically, with a manifest; update `latest`.
    `save(folder)` replaces megatron's writer (e.g. a streaming converter writing the files)."""
    from megatron.core import dist_checkpointing

    t0 = time.time()
    final, tmp = root / name, root / f".tmp-{name}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    try:
        if save is not None:
            save(tmp)
        else:
            _in_process_write_results()
            dist_checkpointing.save(state, str(tmp))
    except BaseException:
        if _rank() == 0:  # nothing half-written stays behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    _write_manifest(tmp, info)
    if _rank() == 0:
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step: keep the old one until the new one is in place
            old = root / f".old-{name}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        _fsync_dir(root)
        if update_latest:
            _atomic_write(root / LATEST, name)
        if keep_last:
            _prune(root, keep_last)
        print(f"[checkpoint] saved {final} in {time.time() - t0:.1f}s", flush=True)
    _barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted(p for p in root.glob("step_*") if (p / MANIFEST).is_file())
    for old in steps[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(actor, path: str | Path, *, optimizer: bool = True, rng: bool = True,
                    verify: str = "crc32", resume: bool = True) -> dict[str, Any]:
    """Collective. Loads into `actor` (any layout); returns the saved progress dict.

    Optimizer state and RNG are restored only when asked for; RNG streams are per rank, so they
    are restored only when the layout is the same as at save time. `resume=False` takes the
    weights only: the actor keeps its own step count (a new run started from another's).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_rl.checkpoint.safe_io import (
        METADATA_FILE,
        load_dcp_metadata,
        restricted_megatron_reads,
        unwrap_dcp_error,
    )

    folder = resolve_checkpoint(path)
    manifest = verify_checkpoint(folder, verify)
    # a refusal here names file and class; inside megatron's load DCP would wrap it
    load_dcp_metadata(folder / METADATA_FILE)
    contents = manifest["contents"]
    hf_layout = manifest.get("hf_layout")
    if hf_layout is not None and not (isinstance(hf_layout, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in hf_layout.items())):
        raise CheckpointError(f"{folder / MANIFEST}: hf_layout is not a table of expert "
                              "group → layout")
    optimizer = optimizer and "optimizer" in contents  # e.g. a model converted from HF
    rng = rng and "rng" in contents
    same_layout = manifest.get("layout") == _layout(actor)
    if manifest.get("model") not in (None, actor.spec.name):
        raise CheckpointError(f"{folder} holds model '{manifest['model']}', "
                              f"but the actor is '{actor.spec.name}'")
    state = _sharded_state(actor, rng=rng and same_layout)
    if optimizer:
        state["optimizer"], common = _optimizer_state(actor, state["model"], loading=True)
    try:
        # the checkpoint is untrusted input: nothing in it is unpickled beyond plain data
        with restricted_megatron_reads():
            # megatron's naming: "unexpected" = asked for but absent from the checkpoint
            loaded, _extra_in_ckpt, absent = dist_checkpointing.load(
                state, str(folder), strict=StrictHandling.RETURN_ALL)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # megatron raises many types; name the folder
        cause = unwrap_dcp_error(e)
        if isinstance(cause, CheckpointError):
            raise cause from e
        raise CheckpointError(f"cannot load {folder}: {type(e).__name__}: {e}") from e
    # `_extra_state` (TE's FP8 scaling history; None for local layers) may be absent, e.g.
    # from an HF import: modules then keep their freshly built state
    absent = sorted(k for k in absent if "_extra_state" not in k)
    if absent:
        shown = ", ".join(absent[:8])
        raise CheckpointError(f"{folder} lacks {len(absent)} tensors the model needs: {shown}")
    result = actor.model[0].module.load_state_dict(loaded["model"], strict=False)
    wrong = [k for k in (*result.missing_keys, *result.unexpected_keys)
             if not k.endswith("_extra_state")]
    if wrong:
        raise CheckpointError(f"{folder}: state does not fit the model: {wrong[:8]}")
    if optimizer:
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
        from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

        dict_list_map_inplace(
            lambda v: v.unwrap() if isinstance(v, LocalNonpersistentObject) else v, common)
        actor.optimizer_steps = int(loaded["optimizer_step"])
        opt_state = merge(common, loaded["optimizer"])
        _restore_step(opt_state, actor.optimizer_steps)
        actor.optimizer.load_state_dict(opt_state)
        actor.scheduler.load_state_dict(loaded["scheduler"])
    if rng and same_layout:
        _set_rng_state(loaded["rng"])
    progress = dict(loaded.get("progress", {"step": 0}))
    if resume:
        actor.step = int(progress["step"])
    # kept for the actor's own checkpoints, so their export writes the source's layout
    actor.hf_layout = hf_layout
    return progress
