"""The policy engines of a run, wherever they run: one embedded engine in the driver process
(`rollout.ray=false`), or the engine pools Ray places (`launch_rollout`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_rl.config.schema import Config
from megatron_rl.engines.colocation import ColocationSchedule

if TYPE_CHECKING:
    from megatron_rl.distributed.ray_placement import Placement


@dataclass
class Engines:
    """The policy engines, wherever they run: what agents call, where weight sync pushes."""

    policy: Any                       # a RolloutEngine
    urls: list[str]                   # the engine servers (weight sync's targets)
    aux_urls: dict[str, list[str]]    # aux pools' OpenAI base URLs (judge, summarizer, ...)
    schedule: ColocationSchedule | None  # colocation: engines parked while the trainer steps
    core: Any                         # the in-process engine (its busy seconds), or None
    stop: Callable[[], None]

    @contextlib.contextmanager
    def parked(self, loop: asyncio.Runner) -> Iterator[None]:
        """Colocated engines paused and their memory released for the block; a no-op for
        disaggregated ones. (A run step uses `update_and_sync`: the order of docs/placement.md.)"""
        if self.schedule is None:
            yield
            return
        loop.run(self.schedule.release())
        try:
            yield
        finally:
            loop.run(self.schedule.resume())

    def update_and_sync(self, loop: asyncio.Runner, update: Callable[[], dict],
                        sync: Callable[[], dict], *, onload: Callable[[], dict] | None = None,
                        offload: Callable[[], dict] | None = None) -> dict[str, Any]:
        """The trainer's update and its weight sync; colocated engines in the schedule's order
        (engines release → trainer onload → update → trainer offload → engine weights →
        sync → engine KV cache). Disaggregated: update, then sync."""
        if self.schedule is None or not self.schedule.enabled:
            return {**update(), **sync()}
        return loop.run(self.schedule.update_and_sync(update, sync, onload=onload,
                                                      offload=offload))

    async def aclose(self) -> None:
        """Close the driver's client of an in-process engine (its session lives in the run's
        loop); engine pools close in `stop`."""
        if self.core is not None:
            await self.policy.close()

    def busy_seconds(self) -> float | None:
        """Seconds the in-process engine spent generating so far (None for engine processes)."""
        return self.core.busy_seconds if self.core is not None else None


def start_engines(cfg: Config, spec: Any, tokenizer: Any,
                  placement: Placement | None = None) -> Engines:
    """One embedded engine in this process (`rollout.ray` off), else the engine pools Ray
    places (`launch_rollout`: engine processes that restart, SGLang on GPU, aux pools), in
    `placement` when the trainer ranks already hold it (Ray trainer ranks), else in placement
    groups of their own. Engines without `rollout.model_path` start from random weights of the
    policy's architecture: the first weight sync replaces them with the trainer's."""

    ro = cfg.rollout
    if not ro.ray:
        import transformers

        from megatron_rl.engines.embedded import EmbeddedServer, InProcessEngine
        from megatron_rl.engines.kinds import engine_threads

        if ro.engine != "embedded" or ro.num_engines != 1 or ro.aux_pools:
            raise ValueError("rollout.engine=sglang, rollout.num_engines > 1 and "
                             "rollout.aux_pools need rollout.ray=true")
        model = transformers.AutoModelForCausalLM.from_config(spec.hf_config())
        server = EmbeddedServer(model, tokenizer, max_batch_size=ro.max_batch_size,
                                threads=engine_threads(ro),
                                prefix_cache=ro.prefix_cache,
                                fast_output_layer=ro.fast_output_layer).start()
        return Engines(InProcessEngine(server), [server.url], {}, None, server.core, server.stop)
    import ray

    from megatron_rl.distributed.ray_placement import init_ray
    from megatron_rl.engines.ray_engine import launch_rollout

    started = not ray.is_initialized() and ro.ray_address is None
    init_ray(ro)
    if ro.model_path is None and cfg.model.hf_path:  # serve the policy's own checkpoint
        ro = dataclasses.replace(ro, model_path=cfg.model.hf_path)
    rollout = launch_rollout(ro, model_name=None if ro.model_path else cfg.model.name,
                             placement=placement)

    def stop() -> None:
        rollout.close()
        if started:
            ray.shutdown()
    return Engines(rollout.policy, rollout.policy.urls(), rollout.aux_base_urls(),
                   rollout.schedule if rollout.placement.colocated else None, None, stop)
