"""Wire formats for `/update_weights_from_tensor`'s `serialized_named_tensors`.

SGLang 0.5.23 (`MultiprocessingSerializer`, `weight_sync/tensor_bucket.py`): each entry (one per
TP rank) is base64 of a `ForkingPickler` pickle of either a list of `(name, tensor)` pairs or,
with `load_format="flattened_bucket"`, `{"flattened_tensor": uint8 tensor, "metadata": [...]}`
whose metadata items carry `name, shape, dtype, start_idx, end_idx, numel`. Pickled tensors are
*handles* (CUDA IPC / shared memory), so that format only works when trainer and server share
a machine and GPU (the colocated path): `encode_torch_ipc`. The server unpickles with a
`SafeUnpickler` allow-list, which admits `types.SimpleNamespace` for the metadata items.

The embedded engine takes the same request shape with *values* instead of handles, since
unpickling network input is unsafe: each entry is base64 of a safetensors file, either the named
tensors themselves or, flattened, one uint8 `flattened_tensor` with the bucket metadata as JSON
in the safetensors header (`encode_safetensors` / `decode_safetensors`). Its colocated analogue
of SGLang's handles is shared memory: the trainer writes the flattened bucket into a memfd
that dies with it (`process_memory.py`) and sends only its address and metadata as JSON; the
engine maps it and copies straight into its weights (no serialisation, no HTTP payload;
`ShmWriter` / `SharedBucket`).
"""

from __future__ import annotations

import base64
import io
import json
import mmap
from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

from megatron_rl.engines.process_memory import ProcessMemory, map_process_memory
from megatron_rl.utils.parallel_copy import copy_all, copy_shares

FLATTENED = "flattened_bucket"
SHM_FORMAT = "megatron-rl/shm-v2"


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: SGLang resolves dtypes with getattr(torch, name)."""
    return str(dtype).removeprefix("torch.")


def flatten_bucket(named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[dict]]:
    """One uint8 tensor plus per-tensor metadata, laid out as SGLang's FlattenedTensorBucket."""
    if not named:
        raise ValueError("cannot flatten an empty tensor bucket")
    parts, meta, offset = [], [], 0
    for name, t in named:
        flat = t.detach().contiguous().flatten().view(torch.uint8)
        parts.append(flat)
        meta.append({"name": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype),
                     "start_idx": offset, "end_idx": offset + flat.numel(),
                     "numel": flat.numel()})
        offset += flat.numel()
    return torch.cat(parts), meta


def unflatten_bucket(flat: torch.Tensor, meta: list[dict]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for m in meta:
        dtype = getattr(torch, m["dtype"])
        out.append((m["name"], flat[m["start_idx"]:m["end_idx"]].view(dtype).reshape(m["shape"])))
    return out


def split_buckets(named: Iterable[tuple[str, torch.Tensor]],
                  bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into buckets of at most `bucket_bytes` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def buckets_with_last(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                      ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """(bucket, is_last) with one bucket of look-ahead: a weight version moves with the last
    bucket, so tokens generated between buckets keep the old one."""
    held = None
    for bucket in split_buckets(named, bucket_bytes):
        if held is not None:
            yield held, False
        held = bucket
    if held is not None:
        yield held, True


def encode_safetensors(named: list[tuple[str, torch.Tensor]], flattened: bool) -> str:
    from safetensors.torch import save

    if flattened:
        flat, meta = flatten_bucket(named)
        data = save({"flattened_tensor": flat.cpu()},
                    metadata={"format": FLATTENED, "metadata": json.dumps(meta)})
    else:
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in named:
            t = t.detach().cpu().contiguous()
            # safetensors refuses tensors sharing storage (tied embeddings): copy the second
            if t.untyped_storage().data_ptr() in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            tensors[name] = t
        data = save(tensors)
    return base64.b64encode(data).decode("ascii")


class ShmWriter:
    """Trainer side of the shm transport: one shared-memory region, reused for every bucket
    and every sync (fresh pages cost a page fault each; warm ones copy at memcpy speed) and
    grown when a bucket does not fit. `close()` frees it."""

    def __init__(self) -> None:
        self.segment: ProcessMemory | None = None

    def write(self, named: list[tuple[str, torch.Tensor]]) -> str:
        """The bucket flattened into the segment (one copy); returns the payload. The engine
        must have loaded it before the next `write`."""
        total = sum(t.numel() * t.element_size() for _, t in named)
        if self.segment is None or self.segment.size < total:
            self.close()
            self.segment = ProcessMemory(total, "bucket")
        flat = torch.frombuffer(self.segment.map, dtype=torch.uint8, count=max(total, 1))
        meta, offset, runs = [], 0, []
        for name, t in named:
            n = t.numel() * t.element_size()
            runs.append((flat[offset:offset + n],
                         t.detach().contiguous().reshape(-1).view(torch.uint8)))
            meta.append({"name": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype),
                         "start_idx": offset, "end_idx": offset + n, "numel": n})
            offset += n
        # over this process's intra-op threads (a trainer rank's share of the cores)
        copy_all(copy_shares(runs, torch.get_num_threads()))
        del flat, runs  # a live view would keep the segment from closing
        header = {"format": SHM_FORMAT, **self.segment.address, "nbytes": total,
                  "metadata": meta}
        return base64.b64encode(json.dumps(header).encode()).decode("ascii")

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class SharedBucket:
    """Engine side of `ShmWriter`: the named tensors as views of the mapped segment.
    Use as a context manager; the views must not outlive it. `keep`: leave the segment mapped
    for the next bucket of the same update (the trainer writes every bucket into the same
    segment, so its pages are mapped once: a 64 MB bucket faulted ~16k pages in each time);
    the last bucket, or another segment's, unmaps it."""

    _kept: ClassVar[dict[str, tuple[mmap.mmap, int]]] = {}  # label → (map, bytes); one at most

    def __init__(self, header: dict[str, Any], keep: bool = False):
        label, nbytes = header.get("label"), header.get("nbytes")
        kept = self._kept.pop(label, None) if isinstance(label, str) else None
        for other, _ in self._kept.values():  # another update's, left by one that broke off
            _unmap(other)
        self._kept.clear()
        if kept is not None and isinstance(nbytes, int) and 0 < nbytes <= kept[1]:
            self.map, self.size = kept  # this label's memory, checked when it was mapped
        else:
            if kept is not None:
                _unmap(kept[0])
            try:
                # copy-on-write: a writable buffer for torch; nothing here writes to it, so
                # every read sees the trainer's pages as they are now
                self.map = map_process_memory(header, nbytes, writable=False,
                                              what="shm bucket")
            except FileNotFoundError as e:
                raise ValueError(f"{e} (the shm transport needs the engine on the trainer's "
                                 "machine)") from None
            self.size = nbytes
        self.label, self.keep = label, keep
        flat = torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes)
        self.named = unflatten_bucket(flat, header["metadata"])

    def __enter__(self) -> list[tuple[str, torch.Tensor]]:
        return self.named

    def __exit__(self, *exc: object) -> None:
        self.named = []
        if self.keep and exc[0] is None:
            self._kept[self.label] = (self.map, self.size)
        else:
            _unmap(self.map)


def _unmap(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:  # a caller still holds a view: the mapping goes when it does
        pass


def shm_header(payload: str) -> dict[str, Any] | None:
    """The header of an `encode_shm` payload, None for any other payload."""
    raw = base64.b64decode(payload, validate=True)
    if raw[:1] != b"{":
        return None
    header = json.loads(raw)
    return header if header.get("format") == SHM_FORMAT else None


def decode_safetensors(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of encode_safetensors (flattened or not: the header says which)."""
    from safetensors.torch import load

    raw = base64.b64decode(payload, validate=True)
    if not is_safetensors(raw):
        if raw[:1] == b"\x80":
            raise ValueError("payload is a pickle (SGLang's torch-IPC format); this engine "
                             "takes safetensors values (HttpEngine(tensor_transport="
                             "'safetensors'))")
        raise ValueError("payload is not a safetensors file")
    tensors = load(raw)
    header_meta = _safetensors_metadata(raw)
    if header_meta.get("format") == FLATTENED:
        return unflatten_bucket(tensors["flattened_tensor"], json.loads(header_meta["metadata"]))
    return list(tensors.items())


def is_safetensors(raw: bytes) -> bool:
    """8 bytes of little-endian header length, then a JSON header (a pickle starts 0x80 0x0N,
    which a header length can too, so the JSON brace decides)."""
    n = int.from_bytes(raw[:8], "little")
    return len(raw) >= 8 + n and raw[8:9] == b"{"


def _safetensors_metadata(raw: bytes) -> dict[str, str]:
    # the header is 8 bytes of little-endian length then JSON; __metadata__ holds our strings
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]).get("__metadata__", {}) or {}


def encode_torch_ipc(named: list[tuple[str, torch.Tensor]], flattened: bool) -> str:
    """SGLang's own format (MultiprocessingSerializer.serialize(..., output_str=True))."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # registers the tensor reductions (as in SGLang)

    if flattened:
        flat, meta = flatten_bucket(named)
        # SimpleNamespace is on SGLang's SafeUnpickler allow-list; its loader reads attributes
        items = [SimpleNamespace(name=m["name"], shape=torch.Size(m["shape"]),
                                 dtype=getattr(torch, m["dtype"]), start_idx=m["start_idx"],
                                 end_idx=m["end_idx"], numel=m["numel"]) for m in meta]
        obj: Any = {"flattened_tensor": flat, "metadata": items}
    else:
        obj = [(name, t.detach()) for name, t in named]
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")
