"""Ray placement on one machine: a real local Ray (2 CPUs) bound to 127.0.0.1, real placement
groups, and a real judge engine process answering OpenAI chat requests over HTTP."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import psutil
import pytest
import ray

from megatron_rl.config.loader import ConfigError, load_config
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.distributed.ray_placement import (
    ENGINE_SHARE,
    PlacementError,
    init_ray,
    place,
    probe_bundles,
    resolve_node_ip,
)
from megatron_rl.engines.base import GenerateRequest, SamplingParams
from megatron_rl.engines.http_client import HttpEngine
from megatron_rl.engines.ray_engine import launch_rollout
from tests.test_engine_embedded import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def local_ray():
    ip = init_ray(num_cpus=2, object_store_memory=256 << 20)
    yield ip
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE with a chat-template tokenizer (the judge needs one)."""
    path = tmp_path_factory.mktemp("tiny-judge")
    tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@ray.remote
class Holder:
    """Holds its bundle share while alive, so several of them prove the shares fit together."""

    def ip(self) -> str:
        return ray.util.get_node_ip_address()


def _listening(proc: psutil.Process) -> list[str]:
    try:
        conns = proc.net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
    return [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]


def _is_ray(proc: psutil.Process) -> bool:
    try:
        return "ray" in " ".join(proc.cmdline()).lower()
    except psutil.Error:
        return False


def test_ray_is_bound_to_loopback_only(local_ray):
    assert local_ray == "127.0.0.1"
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    assert [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]] == ["127.0.0.1"]
    # every socket any Ray process listens on is loopback (other children of this test
    # process, e.g. the gloo worker pools of other tests, are not Ray's)
    ray_procs = [p for p in psutil.Process().children(recursive=True) if _is_ray(p)]
    ips = {ip for p in ray_procs for ip in _listening(p)}
    assert ips, "found no listening Ray sockets"
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip in ips), ips


def test_colocated_layout_shares_the_trainer_bundles(local_ray):
    cfg = RolloutConfig(layout="colocated", trainer_ranks=2, trainer_cpus=1, num_engines=2)
    pl = place(cfg)
    try:
        assert pl.engine_pg is pl.trainer_pg
        assert pl.trainer_pg.bundle_specs == [{"CPU": 1.0}, {"CPU": 1.0}]
        assert ray.util.placement_group_table(pl.trainer_pg)["state"] == "CREATED"
        assert [s.bundle_index for s in pl.engines] == [0, 1]
        assert all(s.resources == {"CPU": ENGINE_SHARE} for s in pl.engines)
        assert probe_bundles(pl.trainer_pg, [0, 1]) == [("127.0.0.1", [])] * 2
        # a trainer rank and an engine actor live in each bundle at the same time
        actors = [Holder.options(**pl.trainer_options(r)).remote() for r in range(2)]
        actors += [Holder.options(**s.options()).remote() for s in pl.engines]
        assert ray.get([a.ip.remote() for a in actors], timeout=60) == ["127.0.0.1"] * 4
        for a in actors:
            ray.kill(a)
    finally:
        pl.remove()


def test_disaggregated_layout_gives_engines_their_own_bundles(local_ray):
    cfg = RolloutConfig(trainer_ranks=1, trainer_cpus=1, num_engines=2, engine_cpus=0.5)
    pl = place(cfg)
    try:
        assert pl.engine_pg is not pl.trainer_pg
        assert pl.trainer_pg.bundle_specs == [{"CPU": 1.0}]
        assert pl.engine_pg.bundle_specs == [{"CPU": 0.5}, {"CPU": 0.5}]
        for pg in (pl.trainer_pg, pl.engine_pg):
            assert ray.util.placement_group_table(pg)["state"] == "CREATED"
        assert [(s.bundle_index, s.resources) for s in pl.engines] == [(0, {"CPU": 0.5}),
                                                                        (1, {"CPU": 0.5})]
        actors = [Holder.options(**pl.trainer_options(0)).remote()]
        actors += [Holder.options(**s.options()).remote() for s in pl.engines]
        assert ray.get([a.ip.remote() for a in actors], timeout=60) == ["127.0.0.1"] * 3
        # the whole cluster is taken: nothing more fits
        assert ray.available_resources().get("CPU", 0.0) == pytest.approx(0.0)
        for a in actors:
            ray.kill(a)
    finally:
        pl.remove()


@pytest.fixture(scope="module")
def rollout(local_ray, model_dir):
    """A colocated policy engine (in the trainer's bundle) and a judge pool beside it."""
    cfg = load_config(None, [
        f"rollout.model_path={model_dir}", "rollout.layout=colocated", "rollout.trainer_cpus=1",
        "rollout.aux_pools={judge: {engine_cpus: 0.5}}"])
    ro = launch_rollout(cfg.rollout)
    yield ro
    ro.close()


def test_aux_judge_answers_openai_chat_through_its_base_url(rollout):
    assert list(rollout.aux) == ["judge"]
    assert rollout.placement.aux_pgs["judge"].bundle_specs == [{"CPU": 0.5}]
    (base,) = rollout.aux_base_urls()["judge"]
    assert base.startswith("http://127.0.0.1:") and base.endswith("/v1")
    assert base.removesuffix("/v1") not in rollout.policy.urls()

    import openai

    async def ask() -> tuple[str, str, str]:
        messages = [{"role": "user", "content": "a judge compares the answer"}]
        client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)
        try:
            reply = await client.chat.completions.create(
                model="judge", messages=messages, max_tokens=8, temperature=0.0)
        finally:
            await client.close()
        async with HttpEngine(base.removesuffix("/v1")) as http:
            again = await http.chat(messages, max_tokens=8)
        return reply.choices[0].message.content, reply.choices[0].finish_reason, again

    text, finish, again = asyncio.run(ask())
    assert isinstance(text, str) and text.strip()
    assert finish in ("stop", "length")
    assert again == text  # greedy: the same answer through either client


def test_colocation_schedule_parks_the_engine_while_the_trainer_steps(rollout):
    pool, schedule = rollout.policy, rollout.schedule
    assert rollout.placement.colocated and schedule.enabled
    assert [s.bundle_index for s in rollout.placement.engines] == [0]
    req = lambda rid: GenerateRequest(rid=rid, input_ids=[5, 17, 33],  # noqa: E731
                                      sampling=SamplingParams(temperature=0, max_new_tokens=16))

    async def run() -> None:
        ref = await pool.generate(req("before"))
        async with HttpEngine(pool.urls()[0]) as http:
            async with schedule.training():
                info = await http.request("GET", "/server_info")
                assert info["paused"] and info["released"]
                # a request made while the trainer steps waits in the actor, not a 503
                during = asyncio.create_task(pool.generate(req("during")))
                await asyncio.sleep(0.5)
                assert not during.done()
            info = await http.request("GET", "/server_info")
            assert not info["paused"] and not info["released"]
        out = await asyncio.wait_for(during, 60)
        assert out.output_ids == ref.output_ids and out.finish_reason == "length"

    asyncio.run(run())


def _nic_without_ipv4() -> str | None:
    for name, addrs in psutil.net_if_addrs().items():
        if not any(a.family == socket.AF_INET for a in addrs):
            return name
    return None


def test_node_ip_from_a_nic_and_bad_settings_name_the_field(local_ray):
    assert resolve_node_ip() == "127.0.0.1"
    assert resolve_node_ip(nic="lo") == "127.0.0.1"
    assert resolve_node_ip(node_ip="10.1.2.3") == "10.1.2.3"
    with pytest.raises(ConfigError, match=r"rollout.nic='nonexistent0': no such network "
                                          r"interface .*\(have: .*lo"):
        init_ray(RolloutConfig(nic="nonexistent0"))
    bare = _nic_without_ipv4()
    if bare is not None:
        with pytest.raises(ConfigError, match=rf"rollout.nic='{bare}': interface has no IPv4"):
            resolve_node_ip(nic=bare)
    with pytest.raises(ConfigError, match="rollout.node_ip='1.2.3': not an IPv4 address"):
        RolloutConfig(node_ip="1.2.3")
    with pytest.raises(ConfigError, match="rollout.nic: set rollout.node_ip or rollout.nic"):
        load_config(None, ["rollout.nic=lo", "rollout.node_ip=127.0.0.1"])
    with pytest.raises(ConfigError, match="rollout.num_engines=0: must be >= 1"):
        load_config(None, ["rollout.num_engines=0"])
    with pytest.raises(ConfigError, match="rollout.num_engines=0: must be >= 1"):
        RolloutConfig(num_engines=0)
    with pytest.raises(ConfigError, match="rollout.layout='mixed': must be one of"):
        load_config(None, ["rollout.layout=mixed"])
    with pytest.raises(ConfigError, match="rollout.num_engines=3: colocated on CPU"):
        RolloutConfig(layout="colocated", trainer_ranks=2, num_engines=3)
    with pytest.raises(ConfigError, match="rollout.aux_pools.judge.num_engines=0: must be >= 1"):
        load_config(None, ["rollout.model_path=/m", "rollout.aux_pools={judge: "
                                                    "{num_engines: 0}}"])
    with pytest.raises(ConfigError, match="rollout.aux_pools.judge.model_path: required"):
        load_config(None, ["rollout.aux_pools={judge: {}}"])
    # more than the whole cluster: refused at once, not left pending
    free = ray.available_resources().get("CPU")
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"need \{'CPU': 9.0\}; the cluster has only "
                                             r"\{'CPU': 2.0\}"):
        place(RolloutConfig(trainer_ranks=8, num_engines=1))
    assert time.monotonic() - t0 < 5
    assert ray.available_resources().get("CPU") == free  # nothing left behind
