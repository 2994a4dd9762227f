"""Reading torch_dist checkpoints without running code from them.

torch's DCP reader `pickle.load`s `.metadata`, and its load planner `torch.load`s every bytes
entry (megatron's common state, per-rank RNG states, `_extra_state`) with `weights_only=False`:
a planted `__reduce__` would run on load. Here `.metadata` goes through an unpickler that admits
only the globals DCP and megatron write there, and bytes entries through
`torch.load(weights_only=True)` plus the numpy globals of an RNG state. Tensor data DCP already
reads with `weights_only=True`.

The admitted globals were found by saving real checkpoints (model only, with Adam state, at
1 rank and at TP2, EP2, PP2, EP2/TP2 with the distributed optimizer; tiny-dense, tiny-moe,
tiny-qwen3.5; an HF import) and recording every global their pickles name.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from megatron_rl.checkpoint.errors import CheckpointError

METADATA_FILE = ".metadata"  # DCP's global metadata file
_DCP = "torch.distributed.checkpoint"
# (module, name) that a torch_dist `.metadata` may name
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    *((f"{_DCP}.metadata", n) for n in (
        "Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
        "_MEM_FORMAT_ENCODING")),  # TensorProperties pickles its memory format as this enum
    (f"{_DCP}.filesystem", "_StorageInfo"),
    # megatron keeps every rank's save plan in `Metadata.all_local_plans`
    *((f"{_DCP}.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType",
                                       "TensorWriteData")),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how a torch.layout pickles (a table lookup)
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id when the writer was given a Path
})


def _torch_constants() -> dict[str, Any]:
    """torch.float32, torch.contiguous_format, ...: pickled by name, as attributes of torch."""
    return {k: v for k, v in vars(torch).items()
            if isinstance(v, torch.dtype | torch.memory_format)}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only `METADATA_GLOBALS` and torch dtype constants."""

    def __init__(self, file: IO[bytes], path: Path):
        super().__init__(file)
        self.path = path
        self.constants = _torch_constants()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and name in self.constants:
            return self.constants[name]
        raise CheckpointError(f"{self.path}: refused to unpickle {module}.{name} (not a class "
                              "torch's DCP writes into checkpoint metadata)")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.path}: refused a pickle persistent id in checkpoint "
                              "metadata")


def _plain_name(name: Any) -> bool:
    """A file name directly inside the folder: no separators, no `..`, not absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..")
            and not re.search(r"[/\\\x00]", name))


def load_dcp_metadata(path: Path) -> Metadata:
    """A torch_dist `.metadata`, unpickled with the restricted unpickler and checked: every
    storage entry must name a regular file of the same folder."""
    try:
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing (not a torch_dist checkpoint)") from e
    except Exception as e:  # truncated, not a pickle, a refused call's own error, ...
        raise CheckpointError(f"{path}: unreadable checkpoint metadata "
                              f"({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path}: not torch_dist checkpoint metadata")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"{path}: no storage table")
    folder = path.parent
    for index, info in storage.items():
        file = getattr(info, "relative_path", None)
        if not _plain_name(file):
            raise CheckpointError(f"{path}: entry {getattr(index, 'fqn', index)!r} points at "
                                  f"{file!r}, not a file of the checkpoint folder")
        try:
            mode = os.lstat(folder / file).st_mode
        except FileNotFoundError:
            raise CheckpointError(f"{path}: entry {index.fqn!r} is in {file}, which is "
                                  "missing") from None
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{folder / file}: not a regular file (entry {index.fqn!r})")
        if getattr(info, "transform_descriptors", None):  # our writers never compress
            raise CheckpointError(f"{path}: entry {index.fqn!r} asks for stream transforms "
                                  f"{info.transform_descriptors}")
    return metadata


def _numpy_globals() -> list[Any]:
    """What numpy's RNG state (`np.random.get_state()`: a uint32 array) pickles as."""
    import numpy as np

    rebuild = np.empty(0).__reduce__()[0]  # numpy._core.multiarray._reconstruct
    return [rebuild, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def restricted_torch_load(stream: IO[bytes], where: str, map_location: str | None = None) -> Any:
    """`torch.load` of a bytes entry or a legacy common.pt, weights only (tensors, containers,
    scalars, numpy RNG state); `where` names the file (and entry) in errors. `map_location`
    as the caller it replaces had it (DCP: none; megatron's common.pt: "cpu")."""
    allowed = _numpy_globals()
    start = stream.tell()
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(stream, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{where}: refused to unpickle {_refused(stream, start, e, allowed)}"
                              " (checkpoint objects may hold only tensors, containers, scalars "
                              "and RNG states)") from e
    except Exception as e:
        raise CheckpointError(f"{where}: unreadable ({type(e).__name__}: {e})") from e


def _refused(stream: IO[bytes], start: int, error: Exception, allowed: list[Any]) -> str:
    """The globals a refused pickle names (read from its opcodes, never run), `module.name`."""
    ok = {f"{g.__module__}.{g.__qualname__}" for g in allowed}
    try:
        stream.seek(start)
        names = [n for n in torch.serialization.get_unsafe_globals_in_checkpoint(stream)
                 if n not in ok]
    except Exception:
        names = []
    if names:
        return ", ".join(sorted(names))
    found = re.search(r"GLOBAL (\S+)|but got <class '([^']+)'>", str(error))
    return (found.group(1) or found.group(2)) if found else str(error).splitlines()[0]


class _RestrictedBytes:
    """Passes everything to the wrapped DCP load planner, except that bytes entries are
    loaded with `restricted_torch_load` (DefaultLoadPlanner would `torch.load` them with
    weights_only=False) and stored where DefaultLoadPlanner stores them."""

    def __init__(self, planner: Any, reader: SafeFileSystemReader):
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        if (not isinstance(planner, DefaultLoadPlanner)
                or type(planner).load_bytes is not DefaultLoadPlanner.load_bytes):
            raise CheckpointError(f"{reader.path}: load planner {type(planner).__name__} "
                                  "reads bytes entries its own way; refusing to use it")
        self._planner, self._reader = planner, reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        file = self._reader.storage_data[read_item.storage_index].relative_path
        obj = restricted_torch_load(value, f"{Path(self._reader.path) / file} (entry {fqn!r})")
        planner = self._planner
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], obj)
        else:
            planner.state_dict[fqn] = obj


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with restricted unpickling of `.metadata` and bytes entries."""

    # no **kwargs: DCP then never falls back to per-rank `__<rank>.metadata` files (our
    # writers write one global file), and a refusal is not hidden behind that fallback
    def read_metadata(self, *args: Any) -> Metadata:
        metadata = load_dcp_metadata(Path(self.path) / METADATA_FILE)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _RestrictedBytes(planner, self))


def unwrap_dcp_error(e: BaseException) -> BaseException:
    """DCP wraps a reader's exception in CheckpointException (a BaseException): the first
    CheckpointError inside it, else `e`."""
    if isinstance(e, CheckpointException):
        for exc, _trace in e.failures.values():
            if isinstance(exc, CheckpointError):
                return exc
    return e


def _load_legacy_common(checkpoint_dir: str) -> Any:
    """megatron's legacy common.pt (today's writers keep common state inside DCP)."""
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    path = Path(checkpoint_dir) / COMMON_STATE_FNAME
    with path.open("rb") as f:
        return restricted_torch_load(f, str(path), map_location="cpu")


@contextlib.contextmanager
def restricted_megatron_reads() -> Iterator[None]:
    """While open, megatron's dist_checkpointing reads through SafeFileSystemReader (it builds
    its readers in `_get_filesystem_reader`) and loads a legacy common.pt weights-only."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as mtorch

    def reader(checkpoint_dir: str | Path, cache_metadata: bool = False,
               async_strategy: str = "mcore") -> SafeFileSystemReader:
        return SafeFileSystemReader(checkpoint_dir)

    saved = (mtorch._get_filesystem_reader, serialization._get_filesystem_reader,
             serialization.load_common)
    mtorch._get_filesystem_reader = serialization._get_filesystem_reader = reader
    serialization.load_common = _load_legacy_common
    try:
        yield
    finally:
        (mtorch._get_filesystem_reader, serialization._get_filesystem_reader,
         serialization.load_common) = saved
