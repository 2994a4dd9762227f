"""An engine server killed mid-generation loses no request: real Ray, a real embedded server
process serving a real tiny Qwen3-MoE over HTTP, killed with SIGKILL by its PID."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
import ray

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.distributed.ray_placement import init_ray
from megatron_rl.engines.base import (
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    SamplingParams,
)
from megatron_rl.engines.http_client import HttpEngine
from megatron_rl.engines.ray_engine import EnginePool, launch_rollout
from tests.test_engine_embedded import tiny_model

PROMPTS = [[5, 17, 33, 2, 99], [301, 4, 88], [12, 250, 251, 9, 10, 11], [7, 7, 400]]
NEW_TOKENS = 200


@pytest.fixture(scope="module")
def local_ray():
    # by interface name: lo's IPv4 is the node IP
    assert init_ray(RolloutConfig(nic="lo"), num_cpus=2, object_store_memory=256 << 20) == \
        "127.0.0.1"
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(local_ray, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-moe")
    tiny_model().save_pretrained(model_dir)
    cfg = RolloutConfig(model_path=str(model_dir), num_engines=1, health_interval_s=0.5,
                        state_dir=str(tmp_path_factory.mktemp("engines")))
    ro = launch_rollout(cfg)
    yield ro.policy
    ro.close()


def requests(tag: str) -> list[GenerateRequest]:
    return [GenerateRequest(rid=f"{tag}-{i}", input_ids=p,
                            sampling=SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
            for i, p in enumerate(PROMPTS)]


async def generate_all(pool: EnginePool, tag: str) -> list[GenerateResult]:
    return list(await asyncio.gather(*(pool.generate(r) for r in requests(tag))))


async def wait_until_decoding(url: str, tokens: int, timeout_s: float = 60.0) -> dict:
    """Until every request has at least `tokens` output tokens on the server."""
    deadline = time.monotonic() + timeout_s
    async with HttpEngine(url) as http:
        while time.monotonic() < deadline:
            info = await http.request("GET", "/server_info")
            running = info["running"]
            if len(running) == len(PROMPTS) and min(running.values()) >= tokens:
                return running
            await asyncio.sleep(0.02)
    raise TimeoutError(f"requests did not reach {tokens} tokens")


def wait_for_restarts(pool: EnginePool, n: int, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        (stats,) = pool.stats()
        if stats["restarts"] >= n and stats["alive"]:
            return stats
        time.sleep(0.2)
    raise TimeoutError(f"engine did not restart {n} times: {pool.stats()}")


def test_killed_server_mid_generation_loses_no_request(pool):
    assert isinstance(pool, RolloutEngine)
    async def run() -> tuple[list, list, dict, int]:
        reference = await generate_all(pool, "ref")  # uninterrupted
        tasks = [asyncio.create_task(pool.generate(r)) for r in requests("killed")]
        running = await wait_until_decoding(pool.urls()[0], tokens=10)
        (pid,) = pool.pids()
        os.kill(pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        return reference, results, running, pid

    reference, results, running, killed_pid = asyncio.run(run())
    assert all(0 < n < NEW_TOKENS for n in running.values())  # the kill landed mid-generation
    for ref, got in zip(reference, results):
        assert got.finish_reason in ("stop", "length")
        assert got.output_ids == ref.output_ids  # greedy + same weights: the same ids
        assert got.rid.startswith("killed-")
    (stats,) = pool.stats()
    assert stats["restarts"] >= 1 and stats["requeued"] >= len(PROMPTS)
    assert stats["broken"] is None and stats["inflight"] == 0
    assert pool.pids()[0] != killed_pid and not psutil.pid_exists(killed_pid)
    # the restarted server, on the same URL, serves new requests
    again = asyncio.run(generate_all(pool, "after"))
    assert [r.output_ids for r in again] == [r.output_ids for r in reference]


def test_weights_updated_through_the_pool_survive_a_restart(pool):
    new_weights = tiny_model(seed=1).state_dict()  # different weights, same shapes

    async def update_and_generate() -> tuple[list, list]:
        before = await generate_all(pool, "v0")
        await pool.update_weights_from_tensors(iter(new_weights.items()), weight_version=1)
        return before, await generate_all(pool, "v1")

    before, updated = asyncio.run(update_and_generate())
    assert [r.output_ids for r in updated] != [r.output_ids for r in before]
    assert all(r.weight_versions == [1] * len(r.output_ids) for r in updated)

    restarts = pool.stats()[0]["restarts"]
    os.kill(pool.pids()[0], signal.SIGKILL)  # idle: the actor's watch restarts it
    stats = wait_for_restarts(pool, restarts + 1)
    assert stats["weight_version"] == 1 and stats["stale_restarts"] == 0
    replayed = asyncio.run(generate_all(pool, "replayed"))
    assert [r.output_ids for r in replayed] == [r.output_ids for r in updated]
    assert all(r.weight_versions == [1] * len(r.output_ids) for r in replayed)


def test_killing_the_actor_takes_its_server_down(pool):
    (pid,) = pool.pids()
    assert psutil.pid_exists(pid)
    ray.kill(pool.actors[0])  # no cleanup code runs: the server dies with its parent
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"server {pid} outlived its actor"
        time.sleep(0.1)
