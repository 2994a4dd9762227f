"""Engines under Ray: one `EngineActor` per engine server process, and the `EnginePool` facade.

`EngineActor` (a Ray actor, placed in a bundle by `ray_placement`) launches the engine's server
as a child process (the embedded CLI on CPU; `python -m sglang.launch_server` for
engine=sglang), using `sglang.ServerProcess` for launching, health polling and stopping. It
forwards requests to the server with `HttpEngine` and keeps a table of the requests in flight.

The server binds `bind_host(spec)`: the IPv4 of `rollout.nic` on the actor's node, else Ray's
node IP (rollout.node_ip / rollout.nic on the driver's node; 127.0.0.1 for a local run). Off
loopback its control routes need `MEGATRON_RL_ENGINE_TOKEN`, which the actor and the server
inherit from Ray's environment (never a flag, never the actor's arguments); the actor's
`HttpEngine` sends it.

When the server process dies (or stops answering /health), the actor restarts it on the same
port and re-queues every in-flight request, so each caller's `generate` still returns a
complete result. A restarted server starts from the model it was launched with; the actor then
replays what it knows of later weights, in order: the last `update_weights_from_disk` checkpoint
(or one recorded with `record_weights_on_disk`), then the tensor updates sent through the pool
since then (written to the actor's state dir as safetensors when `persist_weight_updates`), then
the weight version, the pause and the memory-release state. A re-queued request is regenerated
from its prompt: greedy (or seeded) requests give the same tokens as an uninterrupted run on the
same weights. Updates sent to the servers directly (`urls()`, NCCL broadcasts) bypass the actor
and cannot be replayed: tokens generated after such a restart carry the older version (counted
in `stale_restarts`), and the caller can push the weights again.

`EnginePool` is the driver-side `RolloutEngine`: it routes `generate` (least-loaded or
round-robin), sends `abort` to the actor holding the request, broadcasts the control calls and
weight updates, and gives `urls()` (servers) and `base_urls()` (OpenAI-compatible `/v1`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rl.distributed.process_groups import free_port
from megatron_rl.engines.base import (
    MEMORY_TAGS,
    TOKEN_ENV,
    EngineError,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    engine_token,
    is_loopback_host,
)
from megatron_rl.engines.kinds import EngineSpec, engine_threads

if TYPE_CHECKING:
    import torch

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.distributed.ray_placement import EngineSlot, Placement

log = logging.getLogger(__name__)


def bind_host(spec: EngineSpec) -> str:
    """The address an engine server binds on this node: the IPv4 of `spec.nic`, else Ray's
    node IP (which `init_ray` set from rollout.node_ip / rollout.nic; 127.0.0.1 by default)."""
    if spec.nic is not None:
        from megatron_rl.distributed.ray_placement import nic_ipv4

        return nic_ipv4(spec.nic)
    import ray

    return ray.util.get_node_ip_address()


def _no_answer(e: EngineError) -> bool:
    """The server never answered (connection refused/reset, timeout): maybe it died."""
    return e.status is None


class EngineActor:
    """One engine server, supervised; used as a Ray actor (`ray.remote(EngineActor)`).

    Methods are async: Ray runs them concurrently on the actor's event loop, so many
    `generate` calls are in flight at once.
    """

    def __init__(self, spec: EngineSpec, name: str, state_dir: str | None = None,
                 host: str | None = None, gpu_ids: list[int] | None = None):
        self.spec = spec
        self.name = name
        self.host = host or bind_host(spec)
        if not is_loopback_host(self.host) and engine_token() is None:
            # the server would refuse too; say so before starting it
            raise EngineError(f"engine {name}: binds {self.host}, not loopback, so its control "
                              f"routes need a token: set {TOKEN_ENV} in the environment Ray "
                              "starts with on every node (the driver's, before init_ray, or "
                              "`ray start`'s); actors and their servers inherit it")
        self.port = free_port(self.host)
        self._own_state = state_dir is None
        root = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="megatron-rl-"))
        self.state = root / name
        (self.state / "updates").mkdir(parents=True, exist_ok=True)
        self.server = spec.server(self.host, self.port, self.state / "server.log", gpu_ids)
        self.client = spec.client(self.server.url)
        # the server is started and restarted from this one long-lived thread: PR_SET_PDEATHSIG
        # fires when the *thread* that forked the child exits
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._thread.submit(self.server.start, True).result()
        self.inflight: dict[str, GenerateRequest] = {}
        self._aborted: set[str] = set()
        self.counters = {"restarts": 0, "restart_attempts": 0, "requeued": 0,
                         "stale_restarts": 0, "completed": 0}
        self.version = spec.weight_version   # last version set through this actor
        self.seen_version = spec.weight_version  # newest version seen on any token
        self.disk: tuple[str, int] | None = None  # last full checkpoint on disk
        self._log: list[tuple[Path, set[str]]] = []  # tensor updates since, in order
        self._staged: dict[str, list[Any]] = {}
        self._lossy_update = False  # an update we could not keep (persistence off)
        self.paused: PauseMode | None = None
        self.released_tags: set[str] = set()  # SGLang memory regions released (docs/placement.md)
        self._epoch = 0          # bumps at every restart
        self._broken: str | None = None
        self._up: asyncio.Event | None = None        # set unless restarting
        self._resumed: asyncio.Event | None = None   # set unless memory is released
        self._lock: asyncio.Lock | None = None
        self._monitor: asyncio.Task | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def _events(self) -> None:
        if self._up is None:  # created on the actor's event loop
            self._up, self._resumed, self._lock = asyncio.Event(), asyncio.Event(), asyncio.Lock()
            self._up.set()
            self._resumed.set()

    async def ready(self) -> str:
        """Start watching the server; returns its URL."""
        self._events()
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch())
        return self.server.url

    def url(self) -> str:
        return self.server.url

    def pid(self) -> int | None:
        return self.server.proc.pid if self.server.proc is not None else None

    def metrics(self) -> dict[str, Any]:
        return {**self.counters, "name": self.name, "url": self.server.url, "pid": self.pid(),
                "alive": self.server.alive(), "inflight": len(self.inflight),
                "weight_version": self.version, "epoch": self._epoch, "broken": self._broken}

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        await self.client.close()
        await asyncio.get_running_loop().run_in_executor(self._thread, self.server.stop)
        self._thread.shutdown(wait=False)
        shutil.rmtree(self.state.parent if self._own_state else self.state / "updates",
                      ignore_errors=True)

    # -- supervision ----------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Restart a dead server even when no request is waiting on it, so the pool heals."""
        failures = 0
        while True:
            await asyncio.sleep(self.spec.health_interval_s)
            if self._broken is not None:
                return
            if self._lock.locked():
                continue
            epoch = self._epoch
            if not self.server.alive():
                cause = f"exited with code {self.server.proc.returncode}"
            elif await self.client.health(timeout_s=10.0):
                failures = 0
                continue
            else:
                failures += 1
                if failures < 3:
                    continue
                cause = "3 failed health checks"
            failures = 0
            try:
                await self._recover(epoch, cause)
            except EngineError:
                log.exception("engine %s cannot be restarted", self.name)
                return
            except Exception:  # a bug must not end the watch
                log.exception("engine %s: restart failed", self.name)

    async def _recover(self, epoch: int, cause: str) -> None:
        """Restart the server (unless someone did since `epoch`) and restore its state."""
        async with self._lock:
            if self._epoch != epoch:
                return
            if self._broken is not None:
                raise EngineError(self._broken)
            log.warning("engine %s (%s) %s: restarting", self.name, self.server.url, cause)
            self._up.clear()
            loop = asyncio.get_running_loop()
            try:
                while True:
                    if self.counters["restart_attempts"] >= self.spec.max_restarts:
                        self._broken = (f"engine {self.name} ({self.server.url}): server {cause}; "
                                        f"restart budget ({self.spec.max_restarts}) spent")
                        raise EngineError(self._broken)
                    self.counters["restart_attempts"] += 1
                    try:
                        await loop.run_in_executor(self._thread, self.server.restart)
                        await self._restore()
                        break
                    except Exception as e:  # a failed start or restore: start again
                        cause = f"failed to restart: {e}"
                        log.warning("engine %s %s", self.name, cause)
                self.counters["restarts"] += 1
                self._epoch += 1
            finally:
                self._up.set()  # waiters resubmit, or see _broken

    async def _restore(self) -> None:
        """Bring the fresh server to the state the old one was in (what we know of it)."""
        if self.disk is not None:
            await self.client.update_weights_from_disk(*self.disk)
        # the replayed tensors, or (none) just the version
        await self.client.update_weights_from_tensors(self._replay(), self.version)
        if self.paused is not None:
            await self.client.pause_generation(self.paused)
        if self.released_tags:
            await self.client.release_memory(sorted(self.released_tags))
        if self.seen_version > self.version or self._lossy_update:
            self.counters["stale_restarts"] += 1
            log.warning("engine %s restarted at weight version %d, but version %d was served: "
                        "updates sent to %s directly cannot be replayed", self.name,
                        self.version, self.seen_version, self.server.url)

    def _replay(self, paths: list[Path] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The kept tensor updates (or the given files), in order, read one file at a time."""
        from safetensors.torch import load_file

        for path in paths if paths is not None else [p for p, _ in self._log]:
            yield from load_file(path).items()

    async def _crashed_since(self, epoch: int) -> bool:
        """Whether the server was (or is being) restarted since `epoch`, or is down now."""
        if self._epoch != epoch or self._lock.locked() or not self.server.alive():
            return True
        healthy = await self.client.health()
        return not healthy or self._epoch != epoch or self._lock.locked()

    async def _wait_up(self) -> None:
        self._events()
        await self._up.wait()
        if self._broken is not None:
            raise EngineError(self._broken)

    async def _control(self, call: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        """A control call; if the server is gone, the restart's restore applies the state the
        caller has already recorded, so the call is not repeated."""
        await self._wait_up()
        epoch = self._epoch
        try:
            return await call()
        except EngineError as e:
            if not _no_answer(e) or not await self._crashed_since(epoch):
                raise
            await self._recover(epoch, f"did not answer ({e})")

    # -- generation -----------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if req.rid in self.inflight:
            raise EngineError(f"engine {self.name}: rid {req.rid!r} is already in flight")
        self.inflight[req.rid] = req
        try:
            while True:
                await self._wait_up()
                await self._resumed.wait()
                if not self._up.is_set():  # a restart began while we waited
                    continue
                if req.rid in self._aborted:  # aborted while being re-queued: nothing kept
                    return GenerateResult(rid=req.rid, output_ids=[], output_logprobs=[],
                                          finish_reason="abort", weight_versions=[],
                                          prompt_tokens=len(req.input_ids))
                epoch = self._epoch
                try:
                    result = await self.client.generate(req)
                except EngineError as e:
                    if not _no_answer(e):
                        raise  # the server answered: a real error (bad request, ...)
                    if not await self._crashed_since(epoch):
                        raise  # alive and well: not a crash (e.g. a request timeout)
                    await self._recover(epoch, f"dropped request {req.rid} ({e})")
                    self.counters["requeued"] += 1
                    continue
                if result.weight_versions:
                    self.seen_version = max(self.seen_version, max(result.weight_versions))
                self.counters["completed"] += 1
                return result
        finally:
            self.inflight.pop(req.rid, None)
            self._aborted.discard(req.rid)

    async def abort(self, rid: str) -> None:
        if rid in self.inflight:
            self._aborted.add(rid)
        try:
            await self.client.abort(rid)
        except EngineError as e:
            if not _no_answer(e):
                raise  # a dead server: the re-queue loop returns the abort

    async def pause_generation(self, mode: PauseMode = "retract") -> None:
        self.paused = mode
        await self._control(lambda: self.client.pause_generation(mode))

    async def continue_generation(self) -> None:
        self.paused = None
        await self._control(self.client.continue_generation)

    @property
    def released(self) -> bool:
        return bool(self.released_tags)

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """Release SGLang memory regions (`tags`; None: all of them)."""
        self._events()
        before = set(self.released_tags)
        self._resumed.clear()  # new requests wait here, not at a server that answers 503
        self.released_tags |= set(tags) if tags is not None else set(MEMORY_TAGS)
        try:
            await self._control(lambda: self.client.release_memory(tags))
        except BaseException:
            self.released_tags = before
            if not before:
                self._resumed.set()
            raise

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        self.released_tags -= set(tags) if tags is not None else set(MEMORY_TAGS)
        await self._control(lambda: self.client.resume_memory(tags))
        if not self.released_tags:
            self._resumed.set()

    async def flush_cache(self) -> None:
        await self._control(self.client.flush_cache)

    async def health(self) -> bool:
        return self._broken is None and self.server.alive() and await self.client.health()

    # -- weights --------------------------------------------------------------------------------

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        self.record_weights_on_disk(path, weight_version)
        await self._control(lambda: self.client.update_weights_from_disk(path, weight_version))

    def record_weights_on_disk(self, path: str, weight_version: int) -> None:
        """Note a full checkpoint the server loaded by other means (replayed after restart)."""
        for f, _ in self._log:
            f.unlink(missing_ok=True)
        self._log, self._lossy_update = [], False
        self.disk = (str(path), weight_version)
        self.version = weight_version
        self.seen_version = max(self.seen_version, weight_version)

    async def stage_weights(self, update_id: str, bucket: list[tuple[str, Any]]) -> None:
        """One bucket of a tensor update: kept on disk (or in memory) until commit."""
        if not self.spec.engine_kind().stages_tensors:
            raise EngineError(f"engine {self.name} ({self.spec.kind}) takes tensor handles "
                              "(torch_ipc) or NCCL broadcasts; send them to urls() directly, "
                              "or use update_weights_from_disk")
        if not self.spec.persist_weight_updates:
            self._staged.setdefault(update_id, []).extend(bucket)
            return
        from safetensors.torch import save_file

        n = len(self._staged.setdefault(update_id, []))
        path = self.state / "updates" / f"{time.time_ns():020d}-{update_id}-{n:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in bucket}, str(path))
        self._staged[update_id].append((path, {k for k, _ in bucket}))

    async def commit_weights(self, update_id: str, weight_version: int) -> None:
        """Send the staged update to the server and make it part of what a restart replays."""
        staged = self._staged.pop(update_id, [])
        if self.spec.persist_weight_updates:
            for path, names in staged:  # later files supersede earlier ones name by name
                for _, older in self._log:
                    older -= names
                self._log.append((path, names))
            for f, names in [e for e in self._log if not e[1]]:
                f.unlink(missing_ok=True)
                self._log.remove((f, names))
            tensors: Iterable[tuple[str, Any]] = self._replay([p for p, _ in staged])
        else:
            self._lossy_update = True
            tensors = staged
        self.version = weight_version
        self.seen_version = max(self.seen_version, weight_version)
        await self._control(lambda: self.client.update_weights_from_tensors(tensors,
                                                                            weight_version))


# -------------------------------------------------------------------------------------------------


class EnginePool:
    """Several `EngineActor`s behind the `RolloutEngine` protocol (driver side, async)."""

    def __init__(self, actors: list[Any], urls: list[str], *, name: str = "policy",
                 routing: str = "least_loaded", bucket_bytes: int = 512 << 20,
                 weight_version: int = 0):
        if routing not in ("least_loaded", "round_robin"):
            raise ValueError(f"routing={routing!r}: 'least_loaded' or 'round_robin'")
        self.actors = list(actors)
        self._urls = list(urls)
        self.name = name
        self.routing = routing
        self.bucket_bytes = bucket_bytes
        self._weight_version = weight_version
        self._load = [0] * len(actors)
        self._dead: set[int] = set()
        self._next = itertools.count()
        self._owner: dict[str, int] = {}

    @classmethod
    def launch(cls, spec: EngineSpec, slots: list[EngineSlot], *, name: str = "policy",
               routing: str = "least_loaded", state_dir: str | None = None,
               timeout_s: float | None = None) -> EnginePool:
        """One actor per slot; returns once every server answers /health."""
        import ray

        # no token travels here: a runtime_env would store it in Ray's GCS and its agent's log
        remote = ray.remote(EngineActor)
        actors = [remote.options(**slot.options(), max_restarts=0, name=None).remote(
                      spec, f"{name}-{slot.index}", state_dir, None, slot.gpu_ids)
                  for slot in slots]
        try:
            urls = ray.get([a.ready.remote() for a in actors],
                           timeout=timeout_s or spec.startup_timeout_s + 60)
        except BaseException:
            for a in actors:
                ray.kill(a)
            raise
        return cls(actors, urls, name=name, routing=routing, bucket_bytes=spec.bucket_bytes,
                   weight_version=spec.weight_version)

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def urls(self) -> list[str]:
        """Each server's own URL (for weight sync straight to the servers)."""
        return list(self._urls)

    def base_urls(self) -> list[str]:
        """OpenAI-compatible base URLs (`.../v1`), one per engine."""
        return [u + "/v1" for u in self._urls]

    def stats(self) -> list[dict[str, Any]]:
        """Per-engine counters (restarts, requeued, stale_restarts, ...); blocking."""
        import ray

        return ray.get([a.metrics.remote() for a in self.actors])

    def pids(self) -> list[int | None]:
        import ray

        return ray.get([a.pid.remote() for a in self.actors])

    @property
    def restarts(self) -> int:
        return sum(s["restarts"] for s in self.stats())

    def _pick(self) -> int:
        live = [i for i in range(len(self.actors)) if i not in self._dead]
        if not live:
            raise EngineError(f"pool {self.name}: every engine actor has died")
        if self.routing == "round_robin":
            return live[next(self._next) % len(live)]
        least = min(self._load[i] for i in live)
        tied = [i for i in live if self._load[i] == least]
        return tied[next(self._next) % len(tied)]

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        import ray

        while True:
            i = self._pick()
            self._load[i] += 1
            self._owner[req.rid] = i
            try:
                return await self.actors[i].generate.remote(req)
            except ray.exceptions.RayActorError:
                # the actor itself (not just its server) is gone: another engine takes it
                log.error("pool %s: engine actor %d died; re-routing %s", self.name, i, req.rid)
                self._dead.add(i)
            finally:
                self._load[i] -= 1
                self._owner.pop(req.rid, None)

    async def abort(self, rid: str) -> None:
        i = self._owner.get(rid)
        if i is not None:
            await self.actors[i].abort.remote(rid)

    async def _all(self, method: str, *args: Any) -> None:
        live = [a for i, a in enumerate(self.actors) if i not in self._dead]
        await asyncio.gather(*(getattr(a, method).remote(*args) for a in live))

    async def pause_generation(self, mode: PauseMode = "retract") -> None:
        await self._all("pause_generation", mode)

    async def continue_generation(self) -> None:
        await self._all("continue_generation")

    async def release_memory(self, tags: list[str] | None = None) -> None:
        await self._all("release_memory", tags)

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self._all("resume_memory", tags)

    async def flush_cache(self) -> None:
        await self._all("flush_cache")

    async def health(self) -> bool:
        oks = await asyncio.gather(*(a.health.remote() for a in self.actors),
                                   return_exceptions=True)
        return all(ok is True for ok in oks)

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        await self._all("update_weights_from_disk", str(path), weight_version)
        self._weight_version = weight_version

    async def record_weights_on_disk(self, path: str, weight_version: int) -> None:
        """Tell the actors the servers now run a checkpoint loaded by other means."""
        await self._all("record_weights_on_disk", str(path), weight_version)
        self._weight_version = weight_version

    async def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, Any]],
                                          weight_version: int) -> None:
        """Buckets go to the object store one at a time, each staged by every actor, then all
        commit (forward to their server, keep for replay): one bucket in flight at most."""
        import ray

        from megatron_rl.engines.tensors import split_buckets

        uid = uuid.uuid4().hex[:12]
        for bucket in split_buckets(named_tensors, self.bucket_bytes):
            ref = ray.put([(n, t.detach().cpu()) for n, t in bucket])
            await self._all("stage_weights", uid, ref)
            del ref
        await self._all("commit_weights", uid, weight_version)
        self._weight_version = weight_version

    def close(self) -> None:
        import ray

        for i, a in enumerate(self.actors):
            if i in self._dead:
                continue
            try:
                ray.get(a.close.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                pass  # already gone, and its server with it (die_with_parent)
            except ray.exceptions.RayError:
                log.exception("closing engine %s-%d", self.name, i)
            ray.kill(a)
        self._dead = set(range(len(self.actors)))


# -------------------------------------------------------------------------------------------------


def engine_spec(cfg: RolloutConfig, *, model_path: str | None = None, engine: str | None = None,
                gpus: int | None = None, random_init: str | None = None) -> EngineSpec:
    """The spec for the policy engines (or, with the overrides, an aux pool's)."""
    path = model_path or cfg.model_path
    return EngineSpec(kind=engine or cfg.engine, model_path=path,
                      random_init=None if path else random_init,
                      max_batch_size=cfg.max_batch_size, threads=engine_threads(cfg),
                      prefix_cache=cfg.prefix_cache, fast_output_layer=cfg.fast_output_layer,
                      gpus=cfg.engine_gpus if gpus is None else gpus,
                      colocated=cfg.layout == "colocated" and gpus is None,
                      max_restarts=cfg.max_restarts, health_interval_s=cfg.health_interval_s,
                      startup_timeout_s=cfg.startup_timeout_s, bucket_bytes=cfg.bucket_mb << 20,
                      persist_weight_updates=cfg.persist_weight_updates, nic=cfg.nic,
                      sglang=_sglang_args(cfg) if gpus is None else {})


def _sglang_args(cfg: RolloutConfig) -> dict[str, Any]:
    """The policy engines' SGLangConfig fields the recipe sets (`megatron-rl plan` sizes them)."""
    args: dict[str, Any] = {}
    if cfg.engine_mem_fraction is not None:
        args["mem_fraction_static"] = cfg.engine_mem_fraction
    if cfg.engine_ep > 1:
        args["ep_size"] = cfg.engine_ep
    return args


@dataclass
class Rollout:
    """What `launch_rollout` started: placement, policy pool, aux pools, colocation schedule."""

    placement: Placement
    policy: EnginePool | None
    aux: dict[str, EnginePool]
    schedule: Any  # ColocationSchedule
    # False when the caller passed the placement in (Ray trainer ranks live in its bundles:
    # removing it would kill them), so the caller removes it
    owns_placement: bool = True

    def aux_base_urls(self) -> dict[str, list[str]]:
        return {name: pool.base_urls() for name, pool in self.aux.items()}

    def close(self) -> None:
        for pool in [*self.aux.values(), *([self.policy] if self.policy else [])]:
            pool.close()
        if self.owns_placement:
            self.placement.remove()


def launch_rollout(cfg: RolloutConfig, *, model_name: str | None = None, policy: bool = True,
                   aux: Iterable[str] | None = None, placement: Placement | None = None,
                   timeout_s: float | None = None) -> Rollout:
    """Place and start the policy engines and the aux pools `cfg` describes (Ray must be up:
    `init_ray`). `model_name` (a registry name) serves random weights when
    `rollout.model_path` is unset; `policy=False` or `aux=[names]` start only some pools."""
    from megatron_rl.distributed.ray_placement import place
    from megatron_rl.engines.colocation import ColocationSchedule

    owns = placement is None
    placement = placement or place(cfg)
    pools: dict[str, EnginePool] = {}
    pool: EnginePool | None = None
    try:
        if any(s.gpu_ids is None and "GPU" in s.pg.bundle_specs[s.bundle_index]
               and len(s.span) > 1 for s in placement.engines):
            placement.resolve_gpus()
        if policy:
            if cfg.model_path is None and model_name is None and cfg.engine == "embedded":
                raise ValueError("rollout.model_path is unset: pass model_name for random "
                                 "weights")
            pool = EnginePool.launch(engine_spec(cfg, random_init=model_name), placement.engines,
                                     routing=cfg.routing, state_dir=cfg.state_dir,
                                     timeout_s=timeout_s)
        for name in (cfg.aux_pools if aux is None else aux):
            ac = cfg.aux_pools[name]
            spec = engine_spec(cfg, model_path=ac.model_path, engine=ac.engine,
                               gpus=ac.engine_gpus)
            pools[name] = EnginePool.launch(spec, placement.aux[name], name=name,
                                            routing=cfg.routing, state_dir=cfg.state_dir,
                                            timeout_s=timeout_s)
    except BaseException:
        for p in [*pools.values(), *([pool] if pool else [])]:
            p.close()
        if owns:
            placement.remove()
        raise
    schedule = ColocationSchedule([pool] if pool else [], enabled=placement.colocated)
    return Rollout(placement, pool, pools, schedule, owns_placement=owns)
