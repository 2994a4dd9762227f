"""How each engine server starts and which client speaks to it (`engines/registry.py`).

An `EngineKind` turns an `EngineSpec` into the server's command line and environment and
builds its `HttpEngine` client. A user's own server (anything with SGLang's HTTP surface) is
a class with these methods, named by import path in `rollout.engine`."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from megatron_rl.engines.http_client import HttpEngine
from megatron_rl.engines.registry import ENGINES
from megatron_rl.engines.sglang import ServerProcess, SGLangConfig

if TYPE_CHECKING:
    from megatron_rl.config.schema import RolloutConfig

# Make the server die with its parent (Linux PR_SET_PDEATHSIG), so a killed actor or driver
# leaves no orphaned server behind; then exec the real command (the pid stays the server's).
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n")


def die_with_parent(cmd: list[str]) -> list[str]:
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


class EngineKind(Protocol):
    # tensor weight updates can be staged by the supervising actor (CPU tensors over HTTP)
    stages_tensors: bool

    def validate(self, spec: EngineSpec) -> None: ...

    def command(self, spec: EngineSpec, host: str, port: int
                ) -> tuple[list[str], dict[str, str], str | None]:
        """(argv, extra environment, the Python module the server needs or None)."""
        ...

    def client(self, spec: EngineSpec, url: str) -> HttpEngine: ...


class EmbeddedKind:
    """The embedded CPU engine (`python -m megatron_rl.engines.embedded`)."""

    stages_tensors = True

    def validate(self, spec: EngineSpec) -> None:
        if (spec.model_path is None) == (spec.random_init is None):
            raise ValueError("embedded engine: set model_path or random_init")

    def command(self, spec: EngineSpec, host: str, port: int
                ) -> tuple[list[str], dict[str, str], str | None]:
        # no secret here: the engine token reaches the server through its environment
        cmd = [sys.executable, "-m", "megatron_rl.engines.embedded", "--host", host,
               "--port", str(port), "--weight-version", str(spec.weight_version),
               "--max-batch-size", str(spec.max_batch_size), "--threads", str(spec.threads),
               "--control-timeout-s", str(spec.control_timeout_s)]
        cmd += [] if spec.prefix_cache else ["--no-prefix-cache"]
        cmd += ["--fast-output-layer"] if spec.fast_output_layer else []
        cmd += (["--model", str(spec.model_path)] if spec.model_path
                else ["--random-init", str(spec.random_init), "--seed", str(spec.seed)])
        return cmd, {}, None

    def client(self, spec: EngineSpec, url: str) -> HttpEngine:
        return HttpEngine(url, timeout_s=spec.request_timeout_s, bucket_bytes=spec.bucket_bytes,
                          weight_version=spec.weight_version)


class SGLangKind:
    """`python -m sglang.launch_server` (GPU); weights arrive as torch-IPC handles."""

    stages_tensors = False

    def validate(self, spec: EngineSpec) -> None:
        if spec.model_path is None or spec.random_init is not None:
            raise ValueError("sglang engine: set model_path (random_init is embedded only)")

    def command(self, spec: EngineSpec, host: str, port: int
                ) -> tuple[list[str], dict[str, str], str | None]:
        cfg = SGLangConfig(model_path=str(spec.model_path), tp_size=max(spec.gpus, 1),
                           host=host, port=port, weight_version=spec.weight_version,
                           enable_memory_saver=spec.colocated, **spec.sglang)
        return cfg.command(), cfg.environment(), "sglang"

    def client(self, spec: EngineSpec, url: str) -> HttpEngine:
        return HttpEngine(url, timeout_s=spec.request_timeout_s, tensor_transport="torch_ipc",
                          num_tp_payloads=max(spec.gpus, 1), bucket_bytes=spec.bucket_bytes,
                          weight_version=spec.weight_version)


def engine_threads(cfg: RolloutConfig) -> int:
    """An embedded engine's generation threads: its CPU share, at least one."""
    return max(1, int(cfg.engine_cpus))


@dataclass
class EngineSpec:
    """How an engine server is launched (travels to the actor, so plain data only)."""

    kind: str = "embedded"                  # an ENGINES entry: embedded | sglang | import path
    model_path: str | None = None           # HF directory
    random_init: str | None = None          # embedded: a registry model with random weights
    seed: int = 0                           # init seed for random_init
    weight_version: int = 0                 # the version the server starts at
    max_batch_size: int = 32                # embedded
    threads: int = 0                        # embedded: generation threads (0: torch's)
    prefix_cache: bool = True               # embedded: shared prompt prefixes run once
    fast_output_layer: bool = False         # embedded: logits from a transposed copy
    gpus: int = 0                           # sglang: TP size
    colocated: bool = False                 # sglang: memory saver for release/resume
    sglang: dict[str, Any] = field(default_factory=dict)  # more SGLangConfig fields
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 5
    health_interval_s: float = 2.0
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 3600.0
    control_timeout_s: float = 120.0        # embedded: every blocking control call (504 after)
    bucket_bytes: int = 512 << 20
    persist_weight_updates: bool = True
    # the interface the server binds (its IPv4 on the engine's own node); None = Ray's node
    # IP there (rollout.node_ip / rollout.nic on the driver's node, 127.0.0.1 for local runs)
    nic: str | None = None

    def __post_init__(self) -> None:
        self.engine_kind().validate(self)

    def engine_kind(self) -> EngineKind:
        return ENGINES.get(self.kind, "rollout.engine")()

    def server(self, host: str, port: int, log_path: Path,
               gpu_ids: list[int] | None = None) -> ServerProcess:
        cmd, env, require = self.engine_kind().command(self, host, port)
        env = {**env, **self.env}
        if gpu_ids is not None:  # a colocated engine spanning several trainer bundles
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
        return ServerProcess(die_with_parent(cmd), f"http://{host}:{port}", env=env,
                             log_path=log_path, startup_timeout_s=self.startup_timeout_s,
                             require=require)

    def client(self, url: str) -> HttpEngine:
        return self.engine_kind().client(self, url)
