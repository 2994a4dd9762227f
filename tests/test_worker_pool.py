from __future__ import annotations

import os
import time

import pytest
import torch

from megatron_rl.distributed.worker_pool import WorkerError, WorkerPool
from tests import dist_cases


def _sleep(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_results_in_rank_order(pool2):
    assert pool2.run(dist_cases.rank_of_failure, -1) == [0, 1]


def _fingerprint(tensors: dict) -> dict:
    """Per tensor its dtype, shape, strides and bytes' digest; which ones share memory."""
    import hashlib

    out = {k: (t.dtype, tuple(t.shape), t.stride(), hashlib.sha256(
        t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest())
        for k, t in tensors.items()}
    storages = [t.untyped_storage().data_ptr() for t in tensors.values()]
    return {"tensors": out, "distinct storages": len(set(storages))}


def test_small_jobs_are_pickled_once_inline_and_large_tensors_still_arrive(pool2):
    """A job up to INLINE_BYTES goes to every rank as one inline pickle (an RL step's batch),
    a tensor that is its whole storage as raw bytes; a larger one as before, its tensors
    through shared memory, as is a job whose tensors share memory (torch's reduction keeps
    them shared). Every one arrives bit for bit, strides and sharing as sent; a slice of a
    larger storage arrives as its elements, contiguous."""
    from megatron_rl.distributed import worker_pool
    from megatron_rl.records.batch import TokenBatch

    gen = torch.Generator().manual_seed(0)
    small = {"ids": torch.randint(0, 640, (8, 600), generator=gen),
             "logp": torch.randn(8, 600, generator=gen), "bf16": torch.randn(5).bfloat16(),
             "mask": torch.rand(3, 4, generator=gen) > 0.5, "scalar": torch.tensor(2.5),
             "empty": torch.zeros(0, 3), "transposed": torch.randn(4, 6, generator=gen).t()}
    base = torch.randn(6, 8, generator=gen)
    shared = {"base": base, "rows": base[2:4], "col": base[:, 1]}
    large = {"w": torch.randn(3 << 20, generator=gen)}  # 12 MB
    assert worker_pool._inline((_fingerprint, (small,), {})) is not None
    assert worker_pool._inline((_fingerprint, (shared,), {})) is None
    assert worker_pool._inline((_fingerprint, (large,), {})) is None
    for job in (small, shared, large):
        assert pool2.run(_fingerprint, job) == [_fingerprint(job)] * 2
    sliced = {"cols": torch.randn(8, 601, generator=gen)[:, 1:], "row": base[3]}
    got = pool2.run(_fingerprint, sliced)
    assert got == [_fingerprint({k: t.contiguous() for k, t in sliced.items()})] * 2
    # an RL batch (its loss mask is a slice) goes without torch.save / torch.load
    batch = TokenBatch.from_sequences(torch.zeros(2, 9, dtype=torch.long), torch.ones(2, 9),
                                      advantages=torch.ones(2, 9))
    assert not batch.loss_mask.is_contiguous()
    assert b"_load_from_bytes" not in worker_pool._inline((_fingerprint, (batch,), {}))
    assert _fingerprint(shared)["distinct storages"] == 1


def test_failure_on_one_rank_names_it_and_pool_survives(pool2):
    with pytest.raises(WorkerError) as info:
        pool2.run(dist_cases.rank_of_failure, 1)
    msg = str(info.value)
    assert "--- rank 1 ---" in msg and "deliberate failure on rank 1" in msg
    assert "--- rank 0 ---" not in msg
    assert pool2.alive and pool2.run(dist_cases.rank_of_failure, -1) == [0, 1]


def test_hung_job_times_out_and_closes_the_pool():
    with WorkerPool(1) as pool:
        pid = pool.run(_sleep, 0)[0]
        with pytest.raises(WorkerError, match="no answer within 1 s"):
            pool.run(_sleep, 30, timeout=1)
        assert not pool.alive
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the rank is gone, not left behind


def test_rebuilding_the_layout_does_not_pile_up_gloo_groups(pool2):
    """Each megatron layout on gloo holds ~60 threads; a pool that builds actor after actor
    (a test session, several runs) must not keep the old ones (they once drove the load of
    this 2-core machine into the hundreds)."""
    counts = pool2.run(dist_cases.threads_after_actors, ["parallel.ep=2"], 3)
    for rank_counts in counts:
        assert rank_counts[-1] <= rank_counts[0] + 4, rank_counts
