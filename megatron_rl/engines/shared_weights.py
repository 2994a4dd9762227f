"""One-copy weight sync: the engine's parameters live in a shared-memory segment the trainer
writes directly (an engine on the trainer's machine).

The embedded engine moves every parameter into one shared-memory region
(`SharedWeightStore`, a memfd that dies with the engine: `process_memory.py`) and publishes its
layout: for each HF checkpoint name whose values sit
contiguously in a parameter, the byte offset, shape and dtype. The trainer maps the segment
writable (`SharedWeightWriter`) and copies each HF-layout tensor straight into the engine's
weights: one pass over the bytes instead of gather buffer → bucket segment → engine copy.

The version flip is pause → write → continue: a begin stops the scheduler between two decode
steps (requests stay in flight), the trainer writes, a commit stamps the new version and lets
decoding go on, so every token is produced by one complete set of weights and carries its
version. Both go over the engine's Unix socket named in the layout (`write_control.py`), or
`/shared_weights/begin` and `/shared_weights/commit` where it is unreachable. A trainer that
dies between the two leaves the engine paused (half-written weights never decode); the next
sync's begin/commit recovers it.

The layout is engine input to the trainer: names, offsets and sizes are checked against the
segment before anything is written (`SharedWeightWriter`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.engines.process_memory import ProcessMemory, map_process_memory
from megatron_rl.engines.tensors import dtype_name

LAYOUT_FORMAT = "megatron-rl/shared-weights-v2"
ALIGN = 64  # bytes: each parameter starts on a cache line
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SharedWeightStore:
    """Engine side: moves `model`'s parameters into one shared-memory region (tied parameters
    stay one tensor) and describes where each checkpoint name lives in it."""

    def __init__(self, model: torch.nn.Module, checkpoint_map: dict[str, tuple[str, Any, tuple]]):
        """`checkpoint_map`: checkpoint name → (parameter name, slice or element index, shape)
        (`WeightLoader.map`)."""
        params = dict(model.named_parameters(remove_duplicate=True))
        offsets: dict[str, int] = {}
        total = 0
        for name, p in params.items():
            if p.dtype not in _DTYPES.values():
                raise ValueError(f"parameter '{name}': dtype {p.dtype} cannot be shared")
            offsets[name] = total
            total += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
        self.memory = ProcessMemory(total, "weights")
        storage = {}
        with torch.no_grad():
            for name, p in params.items():
                n = p.numel() * p.element_size()
                view = torch.frombuffer(self.memory.map, dtype=torch.uint8, count=n,
                                        offset=offsets[name]).view(p.dtype).view(p.shape)
                view.copy_(p.data)
                p.data = view
                storage[p.data.data_ptr()] = name
        self.nbytes = total
        self.tensors: dict[str, dict[str, Any]] = {}
        state = model.state_dict(keep_vars=True)
        for ckpt_name, (target, where, shape) in checkpoint_map.items():
            owner = storage.get(state[target].data_ptr()) if target in state else None
            if owner is None or not isinstance(where, slice):
                continue  # a buffer, or scattered elements: these go by the tensor route
            p = params[owner]
            self.tensors[ckpt_name] = {
                "offset": offsets[owner] + where.start * p.element_size(),
                "shape": list(shape), "dtype": dtype_name(p.dtype)}

    def layout(self) -> dict[str, Any]:
        return {"format": LAYOUT_FORMAT, **self.memory.address, "nbytes": self.nbytes,
                "tensors": self.tensors}

    def close(self) -> None:
        """No new writer can map it; the engine's parameters keep the memory until freed."""
        self.memory.close()


class SharedWeightWriter:
    """Trainer side: the engine's weights mapped writable; `target(name)` is the engine's
    tensor for an HF checkpoint name (None: send that one by the tensor route). `name` is the
    region's label, which a restarted engine changes."""

    def __init__(self, layout: Any):
        if not isinstance(layout, dict) or layout.get("format") != LAYOUT_FORMAT:
            raise ValueError(f"shared-weights layout: expected format '{LAYOUT_FORMAT}'")
        nbytes = layout.get("nbytes")
        self.map = map_process_memory(layout, nbytes, writable=True,
                                      what="shared-weights layout")
        self.flat = torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes)
        self.name, self.nbytes = layout["label"], nbytes
        self.targets: dict[str, torch.Tensor] = {}
        tensors = layout.get("tensors")
        if not isinstance(tensors, dict):
            raise ValueError("shared-weights layout: 'tensors' must be an object")
        for key, t in tensors.items():
            self.targets[key] = self._view(key, t)

    def _view(self, key: str, t: Any) -> torch.Tensor:
        where = f"shared-weights layout: tensor '{str(key)[:200]}'"
        if not isinstance(t, dict):
            raise ValueError(f"{where}: expected an object")
        offset, shape, dtype = t.get("offset"), t.get("shape"), _DTYPES.get(t.get("dtype"))
        if dtype is None:
            raise ValueError(f"{where}: dtype {t.get('dtype')!r} is not one of {list(_DTYPES)}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"{where}: shape must be a list of non-negative integers")
        size = dtype.itemsize
        n = torch.Size(shape).numel() * size
        if not (isinstance(offset, int) and 0 <= offset and offset % size == 0
                and offset + n <= self.nbytes):
            raise ValueError(f"{where}: offset {offset!r} + {n} bytes is outside the segment")
        return self.flat[offset:offset + n].view(dtype).view(shape)

    def target(self, name: str) -> torch.Tensor | None:
        return self.targets.get(name)

    def close(self) -> None:
        self.targets.clear()
        self.flat = None
        try:
            self.map.close()
        except BufferError:  # a caller still holds a view: the mapping goes when it does
            pass
