"""The SGLang adapter: server command lines from a typed config, and a supervisor.

Every flag emitted here exists in SGLang 0.5.23's `ServerArgs` (pinned by
tests/test_sglang_contract.py against the released source). SGLang
itself is imported by nothing here: it runs in its own process, needs a GPU, and is installed
with `pip install -e .[sglang]` on a GPU machine. The client side is `HttpEngine`
(`SGLangConfig.engine()` configures it for SGLang's torch-IPC weight payloads).

Weight versions: SGLang's default version is the string "default"; the protocol's are
integers, so the server is always launched with `--weight-version <int>`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.engines.http_client import HttpEngine

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install -e .[sglang] on a GPU machine"


class SGLangNotInstalled(RuntimeError):
    pass


def require_module(module: str, python: str = sys.executable) -> None:
    """Fail early and clearly when the interpreter that will run the server lacks `module`."""
    if python == sys.executable:
        found = importlib.util.find_spec(module) is not None
    else:
        found = subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                               check=False).returncode == 0
    if not found:
        raise SGLangNotInstalled(f"'{module}' is not importable by {python}: {INSTALL_HINT}")


@dataclass
class SGLangConfig:
    """One `python -m sglang.launch_server` process (which may hold TP x DP GPUs)."""

    model_path: str
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    mem_fraction_static: float | None = None
    # needed for release/resume_memory_occupation (colocated training)
    enable_memory_saver: bool = False
    # routing replay: meta_info.routed_experts per token
    enable_return_routed_experts: bool = False
    weight_version: int = 0
    base_gpu_id: int | None = None
    dtype: str | None = None
    context_length: int | None = None
    random_seed: int | None = None
    trust_remote_code: bool = False
    skip_server_warmup: bool = False
    enable_deterministic_inference: bool = False
    served_model_name: str | None = None
    log_level: str | None = None
    # SGLANG_RETURN_ORIGINAL_LOGPROB: log-probs of the raw logits instead of logits/temperature
    return_original_logprob: bool = False
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable

    def __post_init__(self) -> None:
        for name in ("tp_size", "dp_size", "ep_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.ep_size > 1 and self.tp_size % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide tp_size={self.tp_size} "
                             "(SGLang's expert parallelism runs inside the TP group)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} out of range")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def num_gpus(self) -> int:
        return self.tp_size * self.dp_size

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "sglang.launch_server",
               "--model-path", str(self.model_path),
               "--host", self.host, "--port", str(self.port),
               "--tp-size", str(self.tp_size), "--dp-size", str(self.dp_size),
               "--ep-size", str(self.ep_size),
               "--weight-version", str(self.weight_version)]
        optional: list[tuple[str, Any]] = [
            ("--mem-fraction-static", self.mem_fraction_static),
            ("--base-gpu-id", self.base_gpu_id), ("--dtype", self.dtype),
            ("--context-length", self.context_length), ("--random-seed", self.random_seed),
            ("--served-model-name", self.served_model_name), ("--log-level", self.log_level)]
        for flag, value in optional:
            if value is not None:
                cmd += [flag, str(value)]
        switches = [("--enable-memory-saver", self.enable_memory_saver),
                    ("--enable-return-routed-experts", self.enable_return_routed_experts),
                    ("--trust-remote-code", self.trust_remote_code),
                    ("--skip-server-warmup", self.skip_server_warmup),
                    ("--enable-deterministic-inference", self.enable_deterministic_inference)]
        cmd += [flag for flag, on in switches if on]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(self.env)
        if self.return_original_logprob:
            env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        return env

    def engine(self, **kw: Any) -> HttpEngine:
        """A client for this server: torch-IPC weight payloads, one per TP rank."""
        kw.setdefault("tensor_transport", "torch_ipc")
        kw.setdefault("num_tp_payloads", self.tp_size)
        kw.setdefault("weight_version", self.weight_version)
        return HttpEngine(self.url, **kw)


def http_ok(url: str, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class ServerProcess:
    """Launches one server process, waits for its health endpoint, restarts it when it dies.

    The process runs in its own session, so `stop` ends it and the workers it spawned (SGLang
    starts a scheduler and a detokenizer process per rank) without touching anything else.
    """

    def __init__(self, command: list[str], url: str, *, env: dict[str, str] | None = None,
                 log_path: str | Path | None = None, startup_timeout_s: float = 900.0,
                 health_path: str = "/health", require: str | None = None):
        self.command = command
        self.url = url
        self.env = env or {}
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.health_path = health_path
        self.require = require
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._log_file: Any = None
        self._watch: threading.Thread | None = None
        self._stop_watch = threading.Event()

    def start(self, wait: bool = True) -> ServerProcess:
        if self.require:
            require_module(self.require, self.command[0])
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")  # closed when the process is stopped
        self.proc = subprocess.Popen(self.command, env={**os.environ, **self.env},
                                     stdout=self._log_file or subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.info("started %s (pid %d): %s", self.url, self.proc.pid, " ".join(self.command))
        if wait:
            self.wait_healthy()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout_s: float = 5.0) -> bool:
        return self.alive() and http_ok(self.url + self.health_path, timeout_s)

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.startup_timeout_s)
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"server {self.url} exited with code "
                                   f"{self.proc.returncode if self.proc else None} during "
                                   f"startup{self._log_tail()}")
            if http_ok(self.url + self.health_path, timeout_s=2.0):
                return
            time.sleep(0.5)
        raise RuntimeError(f"server {self.url} not healthy after "
                           f"{timeout_s or self.startup_timeout_s:g}s{self._log_tail()}")

    def _log_tail(self, n: int = 2000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return f"; log tail ({self.log_path}):\n" + self.log_path.read_bytes()[-n:].decode(
            errors="replace")

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop_watch.set()
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join(timeout=timeout_s)
        self._terminate(timeout_s)

    def _terminate(self, timeout_s: float) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def restart(self) -> None:
        self._terminate(30.0)
        self.restarts += 1
        self.start(wait=True)

    def supervise(self, interval_s: float = 5.0, max_restarts: int = 3,
                  failures_before_restart: int = 3,
                  on_restart: Callable[[ServerProcess], None] | None = None) -> None:
        """Watch in the background: a dead process, or `failures_before_restart` failed health
        checks in a row, triggers a restart (at most `max_restarts`)."""
        self._stop_watch.clear()

        def watch() -> None:
            failures = 0
            while not self._stop_watch.wait(interval_s):
                if not self.alive():
                    failures = failures_before_restart  # dead: no point in waiting
                elif self.healthy():
                    failures = 0
                else:
                    failures += 1
                if failures < failures_before_restart:
                    continue
                if self.restarts >= max_restarts:
                    log.error("server %s failed; restart budget (%d) spent", self.url,
                              max_restarts)
                    return
                log.warning("server %s unhealthy: restarting", self.url)
                try:
                    self.restart()
                except RuntimeError:
                    log.exception("restart of %s failed", self.url)
                    continue
                failures = 0
                if on_restart is not None:
                    on_restart(self)

        self._watch = threading.Thread(target=watch, name=f"supervise-{self.url}", daemon=True)
        self._watch.start()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
