"""Ray for rollout: start or attach a cluster on a chosen IP, and place trainer ranks and engines.

Local runs bind Ray to 127.0.0.1 only. Ray 2.60 silently swaps `--node-ip-address=127.0.0.1`
for the machine's routable address and then listens on every interface, unless
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` is set (a single-node switch; see
/work/shared/notes/slurm-on-one-machine.md). On a multi-NIC cluster the node IP is named
explicitly (`node_ip`) or by interface (`nic`, resolved to its IPv4 with psutil).

Placement (docs/placement.md): one bundle per trainer rank; policy engines either share those
bundles (`colocated`: engine memory is released while the trainer steps, `ColocationSchedule`)
or get bundles of their own (`disaggregated`); aux pools (judge, summarizer) always get their own.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config.loader import ConfigError
from megatron_rl.config.schema import RolloutConfig

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# a colocated engine actor only supervises its server process: it takes this share of a trainer
# bundle and the trainer rank the rest, so both fit in the same bundle
ENGINE_SHARE = 0.2
# set for every Ray process we start: no token auth surprises (a stale ~/.ray/auth_token turns it
# on for `ray start` but not for clients), no usage reporting (there is no network)
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


class PlacementError(RuntimeError):
    """The cluster cannot hold the requested bundles (names the request and what is free)."""


# -- node IP ------------------------------------------------------------------------------------


def nic_ipv4(nic: str, field_name: str = "rollout.nic") -> str:
    """The first IPv4 address of network interface `nic`."""
    import psutil

    addrs = psutil.net_if_addrs()
    if nic not in addrs:
        raise ConfigError(f"{field_name}={nic!r}: no such network interface on "
                          f"{socket.gethostname()} (have: {', '.join(sorted(addrs))})")
    v4 = [a.address for a in addrs[nic] if a.family == socket.AF_INET]
    if not v4:
        raise ConfigError(f"{field_name}={nic!r}: interface has no IPv4 address")
    return v4[0]


def resolve_node_ip(node_ip: str | None = None, nic: str | None = None) -> str:
    """`node_ip`, else the IPv4 of `nic`, else 127.0.0.1 (a local run); both come from a
    validated `RolloutConfig`."""
    if node_ip is not None:
        return node_ip
    return nic_ipv4(nic) if nic is not None else LOOPBACK


def is_loopback(ip: str) -> bool:
    return ipaddress.IPv4Address(ip).is_loopback


def init_ray(cfg: RolloutConfig | None = None, *, address: str | None = None,
             node_ip: str | None = None, nic: str | None = None, num_cpus: int | None = None,
             num_gpus: int | None = None, object_store_memory: int | None = None,
             **ray_kwargs: Any) -> str:
    """Start a local Ray head (address None) or attach to a cluster; returns the node IP.

    Arguments override `cfg` (`rollout.ray_address`, `rollout.node_ip`, `rollout.nic`). A local
    head runs on `node_ip` / the IPv4 of `nic` / 127.0.0.1; with a loopback IP every Ray process
    listens on that IP only. If Ray is already initialised in this process, nothing is started
    and its node IP is returned.
    """
    cfg = cfg or RolloutConfig()
    if node_ip is None and nic is None:
        node_ip, nic = cfg.node_ip, cfg.nic
    address = address if address is not None else cfg.ray_address
    # a local head defaults to loopback; a driver joining a cluster lets Ray pick its IP
    # unless one is named
    ip = (resolve_node_ip(node_ip, nic) if node_ip is not None or nic is not None
          else LOOPBACK if address is None else None)
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    if ip is not None and is_loopback(ip) and address is None:
        # read by Ray at import; set both the variable (child processes) and the constant
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray._private.ray_constants as ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    kw: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING,
                              **ray_kwargs)
    if ip is not None:
        kw["_node_ip_address"] = ip
    if address is None:  # resources are only ours to declare when we start the head
        kw.update(num_cpus=num_cpus, num_gpus=num_gpus, object_store_memory=object_store_memory)
    ray.init(address=address, **kw)
    got = ray.util.get_node_ip_address()
    if ip is not None and got != ip:
        ray.shutdown()
        raise RuntimeError(f"Ray runs on {got}, not the requested node IP {ip}")
    return got


# -- placement ----------------------------------------------------------------------------------


def bundle(cpus: float, gpus: int) -> dict[str, float]:
    out: dict[str, float] = {}
    if cpus > 0:
        out["CPU"] = float(cpus)
    if gpus > 0:
        out["GPU"] = float(gpus)
    return out


def _scaled(b: dict[str, float], share: float) -> dict[str, float]:
    return {k: v * share for k, v in b.items()}


def _actor_options(pg: Any, index: int, resources: dict[str, float]) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index),
            "num_cpus": resources.get("CPU", 0.0), "num_gpus": resources.get("GPU", 0.0)}


@dataclass
class EngineSlot:
    """Where one engine's actor goes: a bundle of a placement group, and its share of it.

    `span` lists the bundles whose GPUs the engine's server uses (a colocated engine with TP
    larger than one trainer bundle spans several); `gpu_ids`, when set by
    `Placement.resolve_gpus`, are those GPUs' ids on the node (the server's
    CUDA_VISIBLE_DEVICES).
    """

    pool: str
    index: int
    pg: Any
    bundle_index: int
    resources: dict[str, float]
    span: list[int] = field(default_factory=list)
    gpu_ids: list[int] | None = None

    def options(self) -> dict[str, Any]:
        """Keyword arguments for `RemoteClass.options(...)`."""
        return _actor_options(self.pg, self.bundle_index, self.resources)


@dataclass
class Placement:
    """The placement groups of one run. `engine_pg is trainer_pg` when colocated."""

    layout: str
    trainer_pg: Any
    trainer_bundle: dict[str, float]
    engine_pg: Any
    engines: list[EngineSlot]
    aux_pgs: dict[str, Any] = field(default_factory=dict)
    aux: dict[str, list[EngineSlot]] = field(default_factory=dict)

    @property
    def colocated(self) -> bool:
        return self.layout == "colocated"

    def groups(self) -> list[Any]:
        pgs = [self.trainer_pg] + ([] if self.colocated else [self.engine_pg])
        return pgs + list(self.aux_pgs.values())

    def trainer_options(self, rank: int) -> dict[str, Any]:
        """Actor options for trainer rank `rank` (the bundle minus a colocated engine's share)."""
        if not 0 <= rank < len(self.trainer_pg.bundle_specs):
            raise IndexError(f"trainer rank {rank} outside 0..{len(self.trainer_pg.bundle_specs)}")
        share = 1.0 - ENGINE_SHARE if self.colocated else 1.0
        return _actor_options(self.trainer_pg, rank, _scaled(self.trainer_bundle, share))

    def wait(self, timeout_s: float = 60.0) -> None:
        import ray

        try:
            ray.get([pg.ready() for pg in self.groups()], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PlacementError(
                f"placement groups not ready after {timeout_s:g}s: asked for "
                f"{[pg.bundle_specs for pg in self.groups()]}, cluster has "
                f"{ray.available_resources()} free") from None

    def resolve_gpus(self, timeout_s: float = 60.0) -> None:
        """Fill each GPU engine's `gpu_ids` from probes in the bundles it spans."""
        for slot in [*self.engines, *(s for slots in self.aux.values() for s in slots)]:
            if slot.span and "GPU" in slot.pg.bundle_specs[slot.span[0]]:
                found = probe_bundles(slot.pg, slot.span, timeout_s)
                slot.gpu_ids = [g for _, ids in found for g in ids]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups():
            with contextlib.suppress(Exception):  # already gone (Ray shut down)
                remove_placement_group(pg)


def _check_fits(requests: list[dict[str, float]], where: str) -> None:
    """Fail fast on requests the whole cluster cannot hold (Ray would wait forever)."""
    import ray

    total = ray.cluster_resources()
    need: dict[str, float] = {}
    for b in requests:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    short = {k: v for k, v in need.items() if v > total.get(k, 0.0) + 1e-9}
    if short:
        have = {k: total.get(k, 0.0) for k in short}
        raise PlacementError(f"{where} need {need}; the cluster has only {have}")


def place(cfg: RolloutConfig, *, timeout_s: float = 60.0) -> Placement:
    """Create (and wait for) the placement groups `cfg` describes."""
    from ray.util.placement_group import placement_group

    trainer_b = bundle(cfg.trainer_cpus, cfg.trainer_gpus)
    engine_b = bundle(cfg.engine_cpus, cfg.engine_gpus)
    requests = [trainer_b] * cfg.trainer_ranks
    if cfg.layout == "disaggregated":
        requests += [engine_b] * cfg.num_engines
    for pool in cfg.aux_pools.values():
        requests += [bundle(pool.engine_cpus, pool.engine_gpus)] * pool.num_engines
    _check_fits(requests, "trainer ranks, engines and aux pools")

    strategy = cfg.placement_strategy
    trainer_pg = placement_group([trainer_b] * cfg.trainer_ranks, strategy=strategy)
    if cfg.layout == "colocated":
        engine_pg = trainer_pg
        span = max(cfg.engine_gpus // cfg.trainer_gpus, 1) if cfg.trainer_gpus else 1
        engines = [EngineSlot("policy", i, trainer_pg, i * span, _scaled(trainer_b, ENGINE_SHARE),
                              list(range(i * span, (i + 1) * span)))
                   for i in range(cfg.num_engines)]
    else:
        engine_pg = placement_group([engine_b] * cfg.num_engines, strategy=strategy)
        engines = [EngineSlot("policy", i, engine_pg, i, engine_b, [i])
                   for i in range(cfg.num_engines)]
    placement = Placement(cfg.layout, trainer_pg, trainer_b, engine_pg, engines)
    for name, pool in cfg.aux_pools.items():
        b = bundle(pool.engine_cpus, pool.engine_gpus)
        pg = placement_group([b] * pool.num_engines, strategy=strategy)
        placement.aux_pgs[name] = pg
        placement.aux[name] = [EngineSlot(name, i, pg, i, b, [i])
                               for i in range(pool.num_engines)]
    try:
        placement.wait(timeout_s)
    except PlacementError:
        placement.remove()
        raise
    return placement


def _probe() -> tuple[str, list[int]]:
    import ray

    return ray.util.get_node_ip_address(), [int(g) for g in ray.get_gpu_ids()]


def probe_bundles(pg: Any, indices: Sequence[int],
                  timeout_s: float = 60.0) -> list[tuple[str, list[int]]]:
    """(node IP, GPU ids) of each bundle, from a tiny task scheduled in it."""
    import ray

    task = ray.remote(_probe)
    refs = []
    for i in indices:
        spec = pg.bundle_specs[i]
        share = {k: min(v, 0.01) for k, v in spec.items()}
        refs.append(task.options(**_actor_options(pg, i, share)).remote())
    return ray.get(refs, timeout=timeout_s)


# -- colocation ---------------------------------------------------------------------------------
