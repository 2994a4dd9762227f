"""Colocated engines and trainer taking turns on the same devices (docs/placement.md).

One run step, in order (SGLang's memory regions are the `tags` "weights", "kv_cache",
"cuda_graph" of /release_memory_occupation and /resume_memory_occupation):

  before training   engines pause (retract: in-flight requests are held, recomputed later),
                    then release all their memory; the trainer onloads its parameters,
                    gradient buffers and optimizer state
  training          the policy update
  before rollout    the trainer offloads to host memory; the engines resume their weights
                    only, receive the new weights (weight sync), then resume their KV cache
                    (and CUDA graphs) and continue generating

Weights come back before the KV cache so the update lands in resident weight memory while the
(larger) KV cache is still free: the peak is trainer-on-host + engine weights + the sync's
buckets, never weights + KV cache + trainer. Every transition is logged with the bytes moved;
`events` keeps them (the tests check the order). With `enabled=False` (disaggregated) the
schedule only runs update then sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from megatron_rl.engines.base import MEMORY_TAGS, PauseMode, RolloutEngine

log = logging.getLogger(__name__)
WEIGHTS, KV_CACHE = ["weights"], ["kv_cache", "cuda_graph"]
Metrics = dict[str, Any]


class ColocationSchedule:
    def __init__(self, engines: Sequence[RolloutEngine], *, enabled: bool = True,
                 pause_mode: PauseMode = "retract"):
        self.engines = list(engines)
        self.enabled = enabled
        self.pause_mode = pause_mode
        self.released = False
        self.weights_back = False  # released, but the weights already resumed
        self.events: list[dict[str, Any]] = []  # (who, what, tags, bytes) in the order done

    def _event(self, who: str, what: str, tags: Sequence[str] = (), nbytes: int | None = None
               ) -> None:
        self.events.append({"who": who, "what": what, "tags": list(tags), "bytes": nbytes,
                            "t": time.perf_counter()})
        size = "" if nbytes is None else f" ({nbytes / 1e6:.1f} MB)"
        log.info("colocation: %s %s%s%s", who, what, f" {list(tags)}" if tags else "", size)

    async def release(self) -> None:
        """Before training: engines paused, then every memory region released."""
        if not self.enabled or self.released:
            return
        await asyncio.gather(*(e.pause_generation(self.pause_mode) for e in self.engines))
        self._event("engines", "pause_generation")
        await asyncio.gather(*(e.release_memory(list(MEMORY_TAGS)) for e in self.engines))
        self._event("engines", "release_memory_occupation", MEMORY_TAGS)
        self.released, self.weights_back = True, False

    async def resume_weights(self) -> None:
        if not self.enabled or not self.released or self.weights_back:
            return
        await asyncio.gather(*(e.resume_memory(WEIGHTS) for e in self.engines))
        self._event("engines", "resume_memory_occupation", WEIGHTS)
        self.weights_back = True

    async def resume_kv_cache(self) -> None:
        """After the sync: the KV cache (and CUDA graphs) back, generation continues."""
        if not self.enabled or not self.released:
            return
        await asyncio.gather(*(e.resume_memory(KV_CACHE) for e in self.engines))
        self._event("engines", "resume_memory_occupation", KV_CACHE)
        await asyncio.gather(*(e.continue_generation() for e in self.engines))
        self._event("engines", "continue_generation")
        self.released = self.weights_back = False

    async def resume(self) -> None:
        """Everything back at once (no sync in between: an aborted step, shutdown)."""
        await self.resume_weights()
        await self.resume_kv_cache()

    @contextlib.asynccontextmanager
    async def training(self) -> AsyncIterator[None]:
        await self.release()
        try:
            yield
        finally:
            await self.resume()

    async def update_and_sync(self, update: Callable[[], Metrics], sync: Callable[[], Metrics],
                              *, onload: Callable[[], Metrics] | None = None,
                              offload: Callable[[], Metrics] | None = None) -> Metrics:
        """One step's trainer side in the colocated order (see the module docstring). The
        callables block (trainer ranks): they run in a thread so this loop keeps serving.
        `onload`/`offload` return the trainer's bytes moved (`memory/..._mb` metrics)."""
        metrics: Metrics = {}
        if not self.enabled:
            metrics.update(await asyncio.to_thread(update))
            metrics.update(await asyncio.to_thread(sync))
            return metrics
        await self.release()
        try:
            if onload is not None:
                moved = await asyncio.to_thread(onload)
                self._event("trainer", "onload", nbytes=_mb_total(moved, "onload"))
                metrics.update(moved)
            metrics.update(await asyncio.to_thread(update))
            if offload is not None:
                moved = await asyncio.to_thread(offload)
                self._event("trainer", "offload", nbytes=_mb_total(moved, "offload"))
                metrics.update(moved)
            await self.resume_weights()
            synced = await asyncio.to_thread(sync)
            self._event("trainer", "weight sync", nbytes=int(synced.get("sync/mb", 0) * 1e6))
            metrics.update(synced)
        finally:
            await self.resume()  # the KV cache; after a failure, the weights first too
        return metrics


def _mb_total(metrics: Metrics, direction: str) -> int:
    return int(metrics.get(f"memory/{direction}_bytes", 0))
