"""A long-lived pool of N ranks joined in one gloo/nccl process group.

Starting a process that imports torch + megatron takes ~10 s here, so tests and CLI tools keep
one pool and send it many jobs. A job is a module-level function run on every rank at once
(SPMD); the pool returns the per-rank results, or raises with the failing rank's traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

from megatron_rl.distributed.process_groups import free_port


class WorkerError(RuntimeError):
    pass


def _worker_main(rank: int, world: int, port: int, threads: int, conn, env: dict) -> None:
    # own process group: closing the pool also ends helpers a rank started (megatron's
    # checkpoint writer runs a multiprocessing Manager server)
    os.setpgid(0, 0)
    os.environ.update(env)
    from megatron_rl.utils.logs import quiet_libraries

    quiet_libraries()
    import torch

    from megatron_rl.utils.host_memory import tune_host_memory

    tune_host_memory()
    torch.set_num_threads(threads)
    from megatron_rl.distributed.process_groups import init_distributed, shutdown_distributed

    try:
        init_distributed("gloo", rank=rank, world_size=world,
                         init_method=f"tcp://127.0.0.1:{port}")
        conn.send(("ready", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            shutdown_distributed()
            return
        fn, args, kwargs = job
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # report everything; the pool decides what to do
            conn.send(("error", traceback.format_exc()))


INLINE_BYTES = 8 << 20


class _NotInline(Exception):
    """Too large, or tensors that share memory (torch's reduction keeps them shared)."""


def _tensor_from_bytes(dtype: Any, shape: tuple[int, ...], data: bytearray) -> Any:
    import torch

    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


class _BoundedPickler(pickle.Pickler):
    """Stops (`_NotInline`) once the tensors met hold more than `limit` bytes, so a large job
    is not serialised in full only to be dropped. A tensor that is its whole storage goes as
    its raw bytes, and so does a slice of a larger one (its elements, arriving contiguous):
    torch's own reduction saves each storage with `torch.save` and loads it with `torch.load`
    (0.32 + 0.38 ms for an RL step's 300 kB batch, 0.08 + 0.04 raw; the batch's one sliced
    mask going that way cost ~1 ms of the dispatch to ranks woken from idle). A transpose or
    an expanded tensor keeps torch's reduction, which keeps its strides."""

    def __init__(self, file: io.BytesIO, limit: int):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.left = limit
        self.storages: set[int] = set()

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        storage = obj.untyped_storage()
        self.left -= storage.nbytes()  # a view pickles its whole storage
        if self.left < 0 or (storage.nbytes() and storage.data_ptr() in self.storages):
            raise _NotInline
        self.storages.add(storage.data_ptr())
        if (type(obj) is not torch.Tensor or obj.device.type != "cpu" or obj.requires_grad
                or obj.layout != torch.strided or not obj.numel()):
            return NotImplemented
        whole = (obj.is_contiguous() and not obj.storage_offset()
                 and storage.nbytes() == obj.nbytes)
        if not whole and obj.nbytes >= storage.nbytes():  # a transpose, an expand
            return NotImplemented
        raw = bytearray(obj.contiguous().reshape(-1).view(torch.uint8).numpy())
        return _tensor_from_bytes, (obj.dtype, tuple(obj.shape), raw)


def _inline(job: tuple) -> bytes | None:
    """The job pickled once with its tensors' bytes inline, for every rank; None when they
    hold more than INLINE_BYTES or that cannot be done. `Connection.send` would move each
    tensor into a shared-memory segment of its own, per rank: an RL step's 300 kB batch took
    3-14 ms a rank that way, ~1 ms inline for both. Large tensors still go through shared
    memory."""
    buffer = io.BytesIO()
    try:
        _BoundedPickler(buffer, INLINE_BYTES).dump(job)
    except Exception:  # too large, or something only the multiprocessing pickler reduces
        return None
    return buffer.getvalue()


class WorkerPool:
    def __init__(self, world_size: int, threads_per_rank: int | None = None,
                 env: dict[str, str] | None = None, start_timeout: float = 300.0):
        self.world_size = world_size
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            # not daemonic: megatron's checkpoint writer starts a helper process; the worker
            # loop ends by itself when this pipe closes
            proc = ctx.Process(target=_worker_main, daemon=False, name=f"mrl-rank{rank}",
                               args=(rank, world_size, port, threads, child, dict(env or {})))
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        atexit.register(self.close)
        self._collect("start", start_timeout)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 600.0,
            **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order."""
        if not self.alive:
            raise WorkerError("worker pool is closed or a rank died")
        job = (fn, args, kwargs)
        payload = _inline(job)
        for conn in self._conns:
            if payload is not None:
                conn.send_bytes(payload)  # `recv` on the rank unpickles it as it would `send`'s
            else:
                conn.send(job)
        return self._collect(getattr(fn, "__name__", str(fn)), timeout)

    def _collect(self, what: str, timeout: float, grace: float = 15.0) -> list[Any]:
        """Gather one answer per rank. If a rank fails, the others are likely blocked in a
        collective: give them `grace` seconds, then close the pool."""
        from multiprocessing.connection import wait

        pending = dict(enumerate(self._conns))
        results: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if errors:
                left = min(left, grace)
            ready = wait(list(pending.values()), timeout=max(left, 0))
            if not ready:
                self.close(force=True)
                stuck = ", ".join(str(r) for r in pending)
                errors.append(f"ranks {stuck} gave no answer within "
                              f"{grace if errors else timeout:.0f} s (pool closed)")
                break
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                del pending[rank]
                try:
                    status, value = conn.recv()
                except EOFError:
                    errors.append(f"--- rank {rank} ---\nprocess died")
                    continue
                if status == "error":
                    errors.append(f"--- rank {rank} ---\n{value}")
                results[rank] = value
        if errors:
            if pending or any("process died" in e for e in errors):
                self.close(force=True)
            raise WorkerError(f"{what} failed:\n" + "\n".join(errors))
        return [results[r] for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def close(self, force: bool = False) -> None:
        for conn in self._conns:
            try:
                if not force:
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=0 if force else 10)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the rank and anything it started
            proc.join()
        self._conns, self._procs = [], []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
