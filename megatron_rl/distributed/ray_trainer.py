"""Trainer ranks as Ray actors: `RayTrainerGroup`, the group of `rollout.trainer_launcher=ray`.

One actor per trainer bundle of the run's placement group (`ray_placement.place`: colocated
with the policy engines or not), so one driver on the head node drives ranks on every node;
jobs are module-level functions run on every rank at once, as on a local `WorkerPool`, and a
failing rank's traceback comes back the same way.

Bring-up fails fast, before any process group exists (a wrong rendezvous otherwise hangs until
the 30-minute collective timeout):
1. every rank reports where it landed: host, Ray node IP, the interface its process groups will
   use (`rollout.trainer_nic`, else the interface that holds the node IP), that interface's
   IPv4, and the GPUs it sees; that interface becomes GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME;
   a missing interface, an interface without IPv4 or missing GPUs is an error naming the rank;
2. rank 0 opens the rendezvous on its interface's IPv4 (`rollout.trainer_master_port`, or a
   free port there) and every rank must TCP-connect to it (`rollout.trainer_master_addr`, else
   that IPv4) within `rollout.preflight_timeout_s`; the ranks that cannot are named, with why;
3. only then `init_process_group` (tcp:// on that address).

Nothing outlives the group: `close()` shuts the process groups down, kills each rank's child
processes and the actors, and removes the placement groups it owns; it also runs at exit and
when SIGTERM/SIGHUP end the driver (while a group is open they raise SystemExit, so every
`with` block unwinds). A driver killed outright leaves its actors to Ray, which kills the
actors of a dead owner.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from megatron_rl.config.loader import ConfigError
from megatron_rl.distributed.worker_pool import WorkerError

if TYPE_CHECKING:
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.distributed.ray_placement import Placement

IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class TrainerLaunchError(WorkerError):
    """The trainer ranks could not be brought up (the message names the ranks and why)."""


def interface_of(ip: str) -> str | None:
    """The interface that holds IPv4 `ip`: one with exactly that address, else one whose subnet
    contains it (127.0.0.11 is on `lo` through 127.0.0.1/8)."""
    import psutil

    want = ipaddress.IPv4Address(ip)
    subnet = None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family != socket.AF_INET:
                continue
            if a.address == ip:
                return name
            net = ipaddress.IPv4Network(f"{a.address}/{a.netmask or '32'}", strict=False)
            if subnet is None and want in net:
                subnet = name
    return subnet


def _ipv4_of(nic: str) -> tuple[str | None, str | None]:
    """(first IPv4 of `nic`, None), or (None, what is wrong)."""
    import psutil

    addrs = psutil.net_if_addrs()
    if nic not in addrs:
        return None, f"no interface {nic!r} on this node (has: {', '.join(sorted(addrs))})"
    v4 = [a.address for a in addrs[nic] if a.family == socket.AF_INET]
    if not v4:
        return None, f"interface {nic!r} has no IPv4 address"
    return v4[0], None


class TrainerRank:
    """One trainer rank (the body of its Ray actor)."""

    def __init__(self, rank: int, world_size: int, env: dict[str, str]):
        os.environ.update(env)
        from megatron_rl.utils.host_memory import tune_host_memory
        from megatron_rl.utils.logs import quiet_libraries

        quiet_libraries()
        tune_host_memory()
        self.rank, self.world_size = rank, world_size
        self._listener: socket.socket | None = None

    def where(self, nic: str | None, gpus: int, backend: str) -> dict[str, Any]:
        """Where this rank runs, with the interface its process groups will use set in the
        environment; `problems` lists what rules this node out."""
        import ray
        import torch

        ip = ray.util.get_node_ip_address()
        info: dict[str, Any] = {
            "rank": self.rank, "host": socket.gethostname(), "ip": ip, "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_devices": torch.cuda.device_count(), "problems": []}
        problems = info["problems"]
        if nic is not None:
            iface, (iface_ip, why) = nic, _ipv4_of(nic)
            if why:
                problems.append(f"rollout.trainer_nic={nic!r}: {why}")
        else:
            iface, iface_ip = interface_of(ip), ip
            if iface is None:
                problems.append(f"no interface holds the node IP {ip}; set "
                                "rollout.trainer_nic")
        info.update(iface=iface, iface_ip=iface_ip)
        if iface is not None and not problems:
            for var in IFNAME_ENV:  # a configured interface wins over the operator's env
                if nic is not None or var not in os.environ:
                    os.environ[var] = iface
            info["ifname_env"] = {v: os.environ[v] for v in IFNAME_ENV}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        if gpus > info["cuda_devices"]:
            problems.append(f"sees {info['cuda_devices']} GPU(s) (CUDA_VISIBLE_DEVICES="
                            f"{visible}), rollout.trainer_gpus={gpus} needed")
        if backend == "nccl" and info["cuda_devices"] == 0:
            problems.append("parallel.backend=nccl but this rank sees no GPU")
        return info

    def listen(self, host: str, port: int) -> int:
        """Open the rendezvous for the preflight; returns the port (a free one for 0)."""
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the store re-binds it next
        try:
            s.bind((host, port))
        except OSError:
            s.close()
            raise
        s.listen(256)
        self._listener = s
        return s.getsockname()[1]

    def unlisten(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def reach(self, host: str, port: int, timeout_s: float) -> str | None:
        """None once a TCP connection to host:port succeeds; else why it did not, after
        retrying for `timeout_s` (rank 0 may not be listening yet)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                socket.create_connection((host, port), timeout=max(min(left, 5.0), 0.1)).close()
                return None
            except OSError as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if time.monotonic() + 0.2 >= deadline:
                return last
            time.sleep(0.2)

    def init(self, backend: str, init_method: str, threads: int,
             timeout_minutes: int = 30) -> None:
        import torch

        from megatron_rl.distributed.process_groups import init_distributed, resolve_backend

        torch.set_num_threads(max(1, threads))
        backend = resolve_backend(backend)
        if backend == "nccl":  # Ray's CUDA_VISIBLE_DEVICES holds just this bundle's GPUs
            os.environ.setdefault("LOCAL_RANK", "0")
        init_distributed(backend, rank=self.rank, world_size=self.world_size,
                         init_method=init_method, timeout_minutes=timeout_minutes)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[str, Any]:
        try:
            return "ok", fn(*args, **kwargs)
        except BaseException:  # report everything; the group decides what to do
            return "error", traceback.format_exc()

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        """Process groups down, and the processes this rank started (a checkpoint writer's
        helper) killed: Ray kills the actor, not its children."""
        import psutil

        from megatron_rl.distributed.process_groups import shutdown_distributed

        shutdown_distributed()
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()


# -- exit hooks -----------------------------------------------------------------------------------

_OPEN: list[RayTrainerGroup] = []
_SAVED_HANDLERS: dict[int, Any] = {}
_HOOK_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds every `with`, so each group closes


def _close_all() -> None:
    for group in list(_OPEN):
        group.close()


atexit.register(_close_all)


def _ours_to_take(handler: Any) -> bool:
    """No handler of the program's own: the default, or Ray's (its Python one, or none at all
    while its C++ core's crash handler holds SIGTERM: that logs the signal and aborts, so the
    `with` blocks would not unwind)."""
    return handler in (signal.SIG_DFL, None) or \
        getattr(handler, "__module__", "").startswith("ray.")


def _opened(group: RayTrainerGroup) -> None:
    if not _OPEN and threading.current_thread() is threading.main_thread():
        for sig in _HOOK_SIGNALS:
            if _ours_to_take(signal.getsignal(sig)):
                _SAVED_HANDLERS[sig] = signal.signal(sig, _on_signal)
    _OPEN.append(group)


def _closed(group: RayTrainerGroup) -> None:
    if group in _OPEN:
        _OPEN.remove(group)
    if not _OPEN and threading.current_thread() is threading.main_thread():
        for sig, old in _SAVED_HANDLERS.items():
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, old)
        _SAVED_HANDLERS.clear()


# -- the group ------------------------------------------------------------------------------------


class RayTrainerGroup:
    """`world_size` trainer ranks as Ray actors in `placement`'s trainer bundles, in one
    process group. `ranks` says where each landed (host, ip, iface, pid, GPUs)."""

    def __init__(self, placement: Placement, cfg: RolloutConfig, backend: str = "gloo", *,
                 owns_placement: bool = False, env: dict[str, str] | None = None,
                 start_timeout_s: float = 300.0):
        import ray

        self.placement, self._owns = placement, owns_placement
        self.world_size = len(placement.trainer_pg.bundle_specs)
        self.ranks: list[dict[str, Any]] = []
        self._closed, self._dead = False, False
        remote = ray.remote(TrainerRank)
        self.actors = [remote.options(**placement.trainer_options(r), max_restarts=0)
                       .remote(r, self.world_size, dict(env or {}))
                       for r in range(self.world_size)]
        _opened(self)
        try:
            self._bring_up(cfg, backend, start_timeout_s)
        except BaseException:
            self.close()
            raise

    # -- bring-up

    def _name(self, rank: int) -> str:
        if rank < len(self.ranks):
            r = self.ranks[rank]
            return f"rank {rank} on {r['host']} ({r['ip']}, iface {r['iface']})"
        return f"rank {rank}"

    def _bring_up(self, cfg: RolloutConfig, backend: str, timeout_s: float) -> None:
        import ray

        self.ranks = self._gather([a.where.remote(cfg.trainer_nic, cfg.trainer_gpus, backend)
                                   for a in self.actors], "preflight", timeout_s)
        problems = [f"rank {r['rank']} on {r['host']} ({r['ip']}): {p}"
                    for r in self.ranks for p in r["problems"]]
        if problems:
            raise TrainerLaunchError("trainer ranks failed the preflight:\n  " +
                                     "\n  ".join(problems))
        r0 = self.ranks[0]
        try:
            port = ray.get(self.actors[0].listen.remote(r0["iface_ip"], cfg.trainer_master_port),
                           timeout=60)
        except ray.exceptions.RayTaskError as e:
            raise TrainerLaunchError(
                f"{self._name(0)} cannot open the rendezvous on {r0['iface_ip']}:"
                f"{cfg.trainer_master_port}: {e.cause if e.cause else e}") from None
        addr = cfg.trainer_master_addr or r0["iface_ip"]
        try:
            why = ray.get([a.reach.remote(addr, port, cfg.preflight_timeout_s)
                           for a in self.actors], timeout=cfg.preflight_timeout_s + 60)
        finally:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(self.actors[0].unlisten.remote(), timeout=30)
        bad = [f"{self._name(r)}: {w}" for r, w in enumerate(why) if w is not None]
        if bad:
            raise TrainerLaunchError(
                f"the rendezvous {addr}:{port} (rank 0 listens on {r0['iface_ip']}:{port} on "
                f"{r0['host']}) is unreachable within {cfg.preflight_timeout_s:g} s from:\n  " +
                "\n  ".join(bad) + "\ncheck rollout.trainer_nic / rollout.trainer_master_addr"
                " and that the port is open between the nodes")
        threads = [max(1, int(self.placement.trainer_options(r)["num_cpus"]))
                   for r in range(self.world_size)]
        self._gather([a.init.remote(backend, f"tcp://{addr}:{port}", threads[r])
                      for r, a in enumerate(self.actors)], "init_process_group", timeout_s)

    # -- jobs

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order (no time
        limit by default: the collectives have their own)."""
        if not self.alive:
            raise WorkerError("ray trainer group is closed or a rank died")
        refs = [a.run.remote(fn, args, kwargs) for a in self.actors]
        answers = self._gather(refs, getattr(fn, "__name__", str(fn)), timeout)
        errors = [f"--- {self._name(r)} ---\n{v}" for r, (s, v) in enumerate(answers)
                  if s == "error"]
        if errors:
            raise WorkerError(f"{getattr(fn, '__name__', fn)} failed:\n" + "\n".join(errors))
        return [v for _, v in answers]

    def _gather(self, refs: list[Any], what: str, timeout: float | None,
                grace: float = 15.0) -> list[Any]:
        """One answer per rank. Once a rank failed the others are likely blocked in a
        collective: they get `grace` seconds, then the group is closed."""
        import ray

        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        errors: list[str] = []
        failed = False  # a rank raised (its error may come back as a result: `run`)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if failed:
                left = grace if left is None else min(left, grace)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                stuck = ", ".join(str(r) for r in sorted(pending.values()))
                errors.append(f"ranks {stuck} gave no answer within {left:.0f} s "
                              "(group closed)")
                self.close()
                break
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                    failed |= isinstance(results[rank], tuple) and results[rank][0] == "error"
                except ray.exceptions.RayActorError as e:
                    self._dead = failed = True
                    errors.append(f"--- {self._name(rank)} ---\nthe rank's process died: "
                                  f"{str(e).splitlines()[0]}")
                except ray.exceptions.RayTaskError as e:
                    failed = True
                    errors.append(f"--- {self._name(rank)} ---\n{e}")
        if errors:
            if pending or self._dead:
                self.close()
            raise WorkerError(f"{what} failed:\n" + "\n".join(errors))
        return [results[r] for r in range(len(refs))]

    # -- lifetime

    @property
    def alive(self) -> bool:
        return not self._closed and not self._dead

    def close(self) -> None:
        """Shut the ranks down (process groups, their children), kill the actors, wait until
        Ray has them dead, and remove the placement groups this group owns."""
        if self._closed:
            return
        self._closed = True
        import ray

        try:
            if ray.is_initialized():
                with contextlib.suppress(ray.exceptions.RayError):
                    ray.get([a.shutdown.remote() for a in self.actors], timeout=15)
                for a in self.actors:
                    with contextlib.suppress(Exception):
                        ray.kill(a, no_restart=True)
                self._wait_dead(timeout_s=30)
                if self._owns:
                    self.placement.remove()
        finally:
            _closed(self)

    def _wait_dead(self, timeout_s: float) -> None:
        import ray

        deadline = time.monotonic() + timeout_s
        for a in self.actors:
            while time.monotonic() < deadline:
                try:
                    ray.get(a.pid.remote(), timeout=2)
                except ray.exceptions.RayActorError:
                    break
                except ray.exceptions.GetTimeoutError:
                    pass
                time.sleep(0.1)

    def describe(self) -> list[str]:
        """One line per rank: where it runs."""
        return [f"trainer rank {r['rank']}: host {r['host']} ip {r['ip']} iface {r['iface']} "
                f"pid {r['pid']} gpus {r['cuda_devices']}" for r in self.ranks]

    def __enter__(self) -> RayTrainerGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@contextlib.contextmanager
def ray_trainer_ranks(rollout: RolloutConfig, backend: str,
                      world_size: int | None = None) -> Iterator[RayTrainerGroup]:
    """Ray up (attached to `rollout.ray_address`, or a local head), the run's placement groups,
    and one trainer rank per trainer bundle; everything this started goes at the end."""
    if "RANK" in os.environ:
        raise ConfigError("rollout.trainer_launcher=ray: this command runs under torchrun, "
                          "which already started the ranks; use trainer_launcher=local")
    if world_size is not None and world_size != rollout.trainer_ranks:
        raise ConfigError(f"rollout.trainer_ranks={rollout.trainer_ranks}: the ray launcher "
                          f"starts one rank per trainer bundle, but {world_size} ranks were "
                          "asked for (--nproc)")
    import ray

    from megatron_rl.distributed.ray_placement import init_ray, place

    started = not ray.is_initialized() and rollout.ray_address is None
    init_ray(rollout)
    try:
        with RayTrainerGroup(place(rollout), rollout, backend, owns_placement=True) as group:
            yield group
    finally:
        if started:
            ray.shutdown()
