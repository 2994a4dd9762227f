"""One long-lived gloo pool per world size for the whole test session.

Starting a rank (torch + megatron imports) costs ~10 s here, so every distributed test sends
jobs to these pools instead of spawning its own processes.
"""

from __future__ import annotations

from megatron_rl.distributed.worker_pool import WorkerPool

_POOLS: dict[int, WorkerPool] = {}


def get_pool(world: int) -> WorkerPool:
    pool = _POOLS.get(world)
    if pool is None or not pool.alive:  # a timed-out job closes its pool; start a fresh one
        pool = _POOLS[world] = WorkerPool(world)
    return pool


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
