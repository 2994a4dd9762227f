"""The SGLang adapter without SGLang: command lines against 0.5.23's real flags, the clear
error when SGLang is missing, and the supervisor (driven with the embedded server's CLI)."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import sys
import time

import pytest

from megatron_rl.engines.sglang import (
    INSTALL_HINT,
    ServerProcess,
    SGLangConfig,
    SGLangNotInstalled,
    require_module,
)
from tests.sglang_fixtures import load_fixture

SERVER = load_fixture("server")


def flags(cmd: list[str]) -> list[str]:
    return [a for a in cmd if a.startswith("--")]


def value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def full_config() -> SGLangConfig:
    return SGLangConfig(
        model_path="/ckpt/hf", tp_size=4, dp_size=2, ep_size=4, port=31000,
        mem_fraction_static=0.7, enable_memory_saver=True, enable_return_routed_experts=True,
        weight_version=3, base_gpu_id=4, dtype="bfloat16", context_length=32768,
        random_seed=1, trust_remote_code=True, skip_server_warmup=True,
        enable_deterministic_inference=True, served_model_name="policy", log_level="warning",
        return_original_logprob=True)


def test_every_server_flag_exists_in_sglang_0_5_23() -> None:
    cmd = full_config().command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    emitted = flags(cmd)
    unknown = sorted(set(emitted) - set(SERVER["server_flags"]))
    assert not unknown, f"not SGLang {SERVER['sglang_version']} flags: {unknown}"
    # every option of the config reaches the command line
    assert len(emitted) == 19
    assert value(cmd, "--host") == "127.0.0.1" and value(cmd, "--port") == "31000"
    assert (value(cmd, "--tp-size"), value(cmd, "--dp-size"), value(cmd, "--ep-size")) == (
        "4", "2", "4")
    assert value(cmd, "--weight-version") == "3"  # integer versions, never SGLang's "default"
    assert value(cmd, "--mem-fraction-static") == "0.7"


def test_defaults_and_extra_flags() -> None:
    cfg = SGLangConfig(model_path="m", extra_args=["--attention-backend", "fa3"])
    cmd = cfg.command()
    assert "--enable-memory-saver" not in cmd and "--mem-fraction-static" not in cmd
    assert cmd[-2:] == ["--attention-backend", "fa3"]
    assert set(flags(cmd)) <= set(SERVER["server_flags"])
    assert cfg.environment() == {}
    assert full_config().environment() == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="ep_size=3 must divide tp_size=4"):
        SGLangConfig(model_path="m", tp_size=4, ep_size=3)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangConfig(model_path="m", mem_fraction_static=1.5)


def test_engine_for_sglang_sends_ipc_payloads_per_tp_rank() -> None:
    eng = full_config().engine()
    assert (eng.url, eng.tensor_transport, eng.num_tp_payloads, eng.weight_version) == (
        "http://127.0.0.1:31000", "torch_ipc", 4, 3)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang installed")
def test_missing_sglang_is_a_clear_error(tmp_path) -> None:
    from megatron_rl.engines.kinds import EngineSpec

    with pytest.raises(SGLangNotInstalled, match=r"'sglang' is not importable.*"
                       + INSTALL_HINT.replace(".", r"\.").replace("[", r"\[")):
        EngineSpec(kind="sglang", model_path="m").server("127.0.0.1", 1, tmp_path / "log").start()
    with pytest.raises(SGLangNotInstalled, match="sglang_router"):
        require_module("sglang_router", sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_supervisor_restarts_a_dead_server(tmp_path) -> None:
    """A real server process (the embedded CLI) is killed; the supervisor brings it back."""
    port = free_port()
    cmd = [sys.executable, "-m", "megatron_rl.engines.embedded",
           "--random-init", "tiny-moe", "--port", str(port)]
    restarted = []
    with ServerProcess(cmd, f"http://127.0.0.1:{port}", log_path=tmp_path / "server.log",
                       startup_timeout_s=120).start() as server:
        assert server.healthy()
        first = server.proc.pid
        server.supervise(interval_s=0.2, on_restart=restarted.append)
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not restarted and time.monotonic() < deadline:
            time.sleep(0.2)
        assert restarted == [server] and server.restarts == 1
        assert server.healthy() and server.proc.pid != first
    assert not server.alive()


def test_startup_failure_shows_the_log(tmp_path) -> None:
    cmd = [sys.executable, "-c", "import sys; print('boom: no GPU'); sys.exit(3)"]
    proc = ServerProcess(cmd, f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "s.log")
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 during startup.*boom: no GPU"):
        proc.start()
