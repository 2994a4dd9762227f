"""The trainer's GPU memory handed to colocated engines between updates (docs/placement.md).

`offload` copies every storage of the actor (parameters, gradient buffers, optimizer state and
fp32 main parameters) to host memory (pinned on GPU) and shrinks the device storage to zero
bytes; `onload` grows it back and copies the bytes in. The storages themselves stay, so every
view of them (DDP's bucket and `main_grad` views, the weight gatherer's parameter views, the
optimizer's references) is valid again after `onload`, with the same bytes.

On CPU there is no device memory to free: by default both calls only count what a GPU run
would move; `release=True` runs the real release on CPU too (the tests check it is exact).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

CATEGORIES = ("model", "grads", "optimizer")


@dataclass
class MoveStats:
    """What one offload / onload moved, in bytes per category."""

    direction: str                       # "offload" | "onload"
    released: bool                       # the device storages were really freed / refilled
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def metrics(self) -> dict[str, float]:
        out = {f"memory/{self.direction}_{k}_mb": v / 1e6 for k, v in self.bytes.items()}
        out[f"memory/{self.direction}_bytes"] = float(self.total)
        out[f"memory/{self.direction}_s"] = self.seconds
        return out


def torch_optimizers(optimizer: Any) -> Iterator[Any]:
    """The torch optimizers inside megatron's (chained) optimizer."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        if inner is not None:
            yield inner


def actor_tensors(model: list[torch.nn.Module], optimizer: Any
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """(category, tensor) of everything a train step keeps on the device between steps."""
    for chunk in model:
        for p in chunk.parameters():
            yield "model", p
        for p in chunk.parameters():
            for g in (getattr(p, "main_grad", None), p.grad):
                if g is not None:
                    yield "grads", g
    for opt in torch_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                yield "optimizer", p  # fp32 main params (the model's own under fp32)
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield "optimizer", v


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Offloader:
    """Holds the host copies between `offload` and `onload` (one actor)."""

    def __init__(self) -> None:
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor, int]] = []
        self._hosts: dict[int, torch.Tensor] = {}  # storage (its C++ impl) → host copy
        self.offloaded = False

    def _storages(self, model: list[torch.nn.Module], optimizer: Any
                  ) -> list[tuple[str, torch.UntypedStorage]]:
        """Each distinct non-empty storage once, in the category that first names it."""
        seen: set[tuple[str, int]] = set()
        out = []
        for category, t in actor_tensors(model, optimizer):
            st = t.untyped_storage()
            key = (str(st.device), st.data_ptr())
            if st.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            out.append((category, st))
        return out

    def offload(self, model: list[torch.nn.Module], optimizer: Any,
                release: bool | None = None) -> MoveStats:
        """Device storages → host; `release` None: only when they are on a GPU."""
        if self.offloaded:
            raise RuntimeError("offload: the actor is already offloaded (onload it first)")
        t0 = time.perf_counter()
        storages = self._storages(model, optimizer)
        if release is None:
            release = any(st.device.type == "cuda" for _, st in storages)
        stats = MoveStats("offload", release)
        for category, st in storages:
            n = st.nbytes()
            stats.bytes[category] += n
            if release:
                host = torch.empty(n, dtype=torch.uint8,
                                   pin_memory=st.device.type == "cuda")
                host.copy_(_bytes_view(st))
                self._held.append((st, host, n))
                self._hosts[st._cdata] = host
        if release:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the copies are done before the storage goes
            for st, _, _ in self._held:
                st.resize_(0)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # back to the driver: the engine allocates it next
        self.offloaded = True
        self._counted = dict(stats.bytes)
        stats.seconds = time.perf_counter() - t0
        return stats

    def readable(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, or while its storage is released the same view of the host copy (weight sync
        reads an offloaded actor's parameters from host memory)."""
        host = self._hosts.get(t.untyped_storage()._cdata)
        if host is None:
            return t
        return torch.empty(0, dtype=t.dtype).set_(host.untyped_storage(), t.storage_offset(),
                                                  t.size(), t.stride())

    def onload(self) -> MoveStats:
        """Host copies → the same device storages (every view valid again)."""
        if not self.offloaded:
            raise RuntimeError("onload: the actor is not offloaded")
        t0 = time.perf_counter()
        stats = MoveStats("onload", bool(self._held), dict(self._counted))
        for st, host, n in self._held:
            st.resize_(n)
            _bytes_view(st).copy_(host, non_blocking=True)
        if self._held and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._held.clear()
        self._hosts.clear()
        self.offloaded = False
        stats.seconds = time.perf_counter() - t0
        return stats
