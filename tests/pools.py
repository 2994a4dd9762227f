"""One long-lived gloo pool per world size for the whole test session.

Starting a rank (torch + megatron imports) costs ~10 s here, so every distributed test sends
jobs to these pools instead of spawning its own processes.

A rank that has built many actors keeps gloo transport threads of destroyed groups alive
(~57 threads per actor that stepped: torch's gloo backend does not join them), and past a few
hundred they busy-poll enough to starve the rest of the suite on 2 cores. So a pool whose
ranks hold more than `MAX_THREADS` threads is replaced before its next job.
"""

from __future__ import annotations

import os

from megatron_rl.distributed.worker_pool import WorkerPool

MAX_THREADS = 400
_POOLS: dict[int, WorkerPool] = {}


def rank_threads() -> int:
    """Threads of this process (a job run on every rank)."""
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def get_pool(world: int) -> WorkerPool:
    pool = _POOLS.get(world)
    if pool is not None and pool.alive and max(pool.run(rank_threads)) > MAX_THREADS:
        pool.close()
    if pool is None or not pool.alive:  # closed above, or a timed-out job closed it
        pool = _POOLS[world] = WorkerPool(world)
    return pool


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
