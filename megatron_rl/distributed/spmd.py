"""Objects that live on every trainer rank, driven from one process.

`RankObjects(group, cls, ...)` builds one `cls` per rank and keeps it between jobs (the ranks'
object table, as Ray keeps its actors); `call(method, ...)` runs the method on every rank at
once (SPMD) and returns the per-rank results. `group` runs module-level jobs on every rank:
a local `WorkerPool`, a `TorchrunGroup` when torchrun started the ranks (rank 0 drives,
the others follow), or a `ray_trainer.RayTrainerGroup` (Ray actors on any node).
"""

from __future__ import annotations

import contextlib
import os
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from megatron_rl.distributed.worker_pool import WorkerError

if TYPE_CHECKING:
    from megatron_rl.config.schema import RolloutConfig

# handle → this rank's object; filled and emptied only by the jobs below
_OBJECTS: dict[str, Any] = {}


class SPMDGroup(Protocol):
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]: ...


def _construct(key: str, cls: type, args: tuple, kwargs: dict) -> None:
    _OBJECTS[key] = cls(*args, **kwargs)


def _call(key: str, method: str, args: tuple, kwargs: dict) -> Any:
    return getattr(_OBJECTS[key], method)(*args, **kwargs)


def _destroy(key: str) -> None:
    obj = _OBJECTS.pop(key, None)
    if obj is not None and hasattr(obj, "close"):
        obj.close()


class RankObjects:
    """One `cls(*args, **kwargs)` on every rank of `group`."""

    def __init__(self, group: SPMDGroup, cls: type, *args: Any, **kwargs: Any):
        self.group, self.key = group, f"{cls.__name__}-{uuid.uuid4().hex[:8]}"
        group.run(_construct, self.key, cls, args, kwargs)
        self.closed = False

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        if self.closed:
            raise WorkerError(f"{self.key} is closed")
        return self.group.run(_call, self.key, method, args, kwargs)

    def close(self) -> None:
        """Drop the objects (calling their `close()`); a dead group has nothing to drop."""
        if self.closed:
            return
        self.closed = True
        if getattr(self.group, "alive", True):
            self.group.run(_destroy, self.key)


class TorchrunGroup:
    """The ranks torchrun started, as a job runner: rank 0 broadcasts each job over a gloo
    group and runs it too; every other rank runs `follow()` until rank 0 calls `close()`.
    Call `init_distributed` first."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._group = dist.new_group(backend="gloo")  # jobs travel on CPU whatever the backend
        self.alive = True

    def _exchange(self, job: Any) -> Any:
        import torch.distributed as dist

        box = [job]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _gather(self, job: tuple) -> list[Any]:
        import torch.distributed as dist

        fn, args, kwargs = job
        try:
            answer = ("ok", fn(*args, **kwargs))
        except BaseException:  # every rank still joins the gather; rank 0 raises
            answer = ("error", traceback.format_exc())
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(answer, out, dst=0, group=self._group)
        return out or []

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        if self.rank != 0:
            raise WorkerError("only rank 0 drives a TorchrunGroup; the others follow()")
        answers = self._gather(self._exchange((fn, args, kwargs)))
        errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in enumerate(answers) if s == "error"]
        if errors:
            raise WorkerError(f"{getattr(fn, '__name__', fn)} failed:\n" + "\n".join(errors))
        return [v for _, v in answers]

    def follow(self) -> None:
        """Run rank 0's jobs until it closes the group."""
        while (job := self._exchange(None)) is not None:
            self._gather(job)
        self.alive = False

    def close(self) -> None:
        if self.rank == 0 and self.alive:
            self._exchange(None)
        self.alive = False


@contextlib.contextmanager
def trainer_ranks(nproc: int, backend: str,
                  rollout: RolloutConfig | None = None) -> Iterator[Any]:
    """The trainer ranks of a command as a job group: `nproc` local gloo ranks, or, under
    torchrun, the ranks it started (rank 0 gets the group and drives; every other rank follows
    rank 0's jobs until it is done, and gets None), or with `rollout.trainer_launcher=ray` one
    Ray actor per trainer bundle (`ray_trainer.RayTrainerGroup`, on any node of the cluster)."""
    if rollout is not None and rollout.trainer_launcher == "ray":
        from megatron_rl.distributed.ray_trainer import ray_trainer_ranks

        with ray_trainer_ranks(rollout, backend, nproc) as group:
            yield group
        return
    if "RANK" not in os.environ:
        from megatron_rl.distributed.worker_pool import WorkerPool

        with WorkerPool(nproc) as pool:
            yield pool
        return
    from megatron_rl.distributed.process_groups import init_distributed, shutdown_distributed

    init_distributed(backend)
    group = TorchrunGroup()
    try:
        if group.rank != 0:
            group.follow()
            yield None
            return
        try:
            yield group
        finally:
            group.close()
    finally:
        shutdown_distributed()
