"""Colocated engines and trainer taking turns on the same devices."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from megatron_rl.engines.base import PauseMode, RolloutEngine


class ColocationSchedule:
    """Engines and trainer take turns on the same bundles.

        async with schedule.training():   # engines paused and their memory released
            actor.train_step(...)
        # memory resumed, generation continues (sync the new weights in between if wanted)

    Engines are paused first (`pause_mode`, default "retract": in-flight requests are held and
    recomputed on continue, never lost), then released. On GPU release/resume free and restore
    the engine's weights and KV cache (SGLang's memory saver); on CPU they only mark the engine
    idle, which is the time-sharing. With `enabled=False` (disaggregated) both are no-ops.
    """

    def __init__(self, engines: Sequence[RolloutEngine], *, enabled: bool = True,
                 pause_mode: PauseMode = "retract"):
        self.engines = list(engines)
        self.enabled = enabled
        self.pause_mode = pause_mode
        self.released = False

    async def release(self) -> None:
        if not self.enabled or self.released:
            return
        await asyncio.gather(*(e.pause_generation(self.pause_mode) for e in self.engines))
        await asyncio.gather(*(e.release_memory() for e in self.engines))
        self.released = True

    async def resume(self) -> None:
        if not self.enabled or not self.released:
            return
        await asyncio.gather(*(e.resume_memory() for e in self.engines))
        await asyncio.gather(*(e.continue_generation() for e in self.engines))
        self.released = False

    @contextlib.asynccontextmanager
    async def training(self) -> AsyncIterator[None]:
        await self.release()
        try:
            yield
        finally:
            await self.resume()
