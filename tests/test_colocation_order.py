"""The colocated order (engines/colocation.py), run with a real trainer rank and the real
embedded engine over SGLang's endpoints: engines release → trainer onload → update → trainer
offload → engine weights back → weight sync → engine KV cache back → generation. The
requests are recorded as sent (endpoint and `tags`, checked against SGLang 0.5.23's structs)
and the engine logs what it applied; the trainer reports the bytes it moved."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from megatron_rl.checkpoint.convert import export_hf
from megatron_rl.config.loader import load_config
from megatron_rl.distributed.spmd import RankObjects
from megatron_rl.engines.base import GenerateRequest, SamplingParams
from megatron_rl.engines.colocation import ColocationSchedule
from megatron_rl.engines.embedded import EmbeddedServer
from megatron_rl.engines.http_client import HttpEngine
from megatron_rl.trainer.worker import TrainerWorker
from tests import dist_cases, rl_cases
from tests.pools import get_pool
from tests.sglang_fixtures import load_fixture, validate_body

MEMORY = ("/release_memory_occupation", "/resume_memory_occupation")
STRUCTS = {"/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
           "/resume_memory_occupation": "ResumeMemoryOccupationReqInput"}


class RecordingEngine(HttpEngine):
    """The real client; every request it sends is noted (endpoint, body) first."""

    def __init__(self, url: str):
        super().__init__(url)
        self.sent: list[tuple[str, dict[str, Any] | None]] = []

    async def request(self, method: str, endpoint: str, body: dict[str, Any] | None = None,
                      **kw: Any) -> Any:
        self.sent.append((endpoint, body))
        return await super().request(method, endpoint, body, **kw)


@pytest.fixture(scope="module")
def initial(tmp_path_factory):
    root = tmp_path_factory.mktemp("coloc")
    init = str(root / "init")
    get_pool(1).run(dist_cases.save_initial, init)
    export_hf(init, str(root / "hf"), "tiny-moe", progress=False)
    return init, root / "hf"


def test_colocated_step_runs_in_order_and_logs_bytes(initial):
    init, hf = initial
    cfg = load_config(None, [*dist_cases.BASE, f"model.seq_length={rl_cases.SEQ}",
                             "train.global_batch_size=4"])
    batch = rl_cases.rollout_batch()[0]
    with EmbeddedServer.from_pretrained(str(hf)).start() as server:
        trainer = RankObjects(get_pool(1), TrainerWorker, cfg, init)
        try:
            trainer.call("connect", [server.url])
            trainer.call("sync", 0)
            first = trainer.call("offload")[0]  # before the first rollout
            engine = RecordingEngine(server.url)
            schedule = ColocationSchedule([engine])
            core = server.core
            core.control_log.clear()

            async def step() -> tuple[dict, Any]:
                metrics = await schedule.update_and_sync(
                    lambda: trainer.call("update", batch, 0.0)[0],
                    lambda: trainer.call("sync", 1)[0],
                    onload=lambda: trainer.call("onload")[0],
                    offload=lambda: trainer.call("offload")[0])
                out = await engine.generate(GenerateRequest("after", [5, 17, 99], SamplingParams(
                    temperature=0, max_new_tokens=4)))
                await engine.close()
                return metrics, out

            metrics, out = asyncio.run(step())
        finally:
            trainer.close()
    # the order, as the schedule did it
    order = [(e["who"], e["what"], tuple(e["tags"])) for e in schedule.events]
    assert order == [
        ("engines", "pause_generation", ()),
        ("engines", "release_memory_occupation", ("kv_cache", "weights", "cuda_graph")),
        ("trainer", "onload", ()),
        ("trainer", "offload", ()),
        ("engines", "resume_memory_occupation", ("weights",)),
        ("trainer", "weight sync", ()),
        ("engines", "resume_memory_occupation", ("kv_cache", "cuda_graph")),
        ("engines", "continue_generation", ())], order
    # as sent over SGLang's endpoints, each body valid for SGLang 0.5.23's request struct
    structs = load_fixture("io_struct")["structs"]
    memory = [(path, body) for path, body in engine.sent if path in MEMORY]
    assert memory == [(MEMORY[0], {"tags": ["kv_cache", "weights", "cuda_graph"]}),
                      (MEMORY[1], {"tags": ["weights"]}),
                      (MEMORY[1], {"tags": ["kv_cache", "cuda_graph"]})]
    for path, body in memory:
        validate_body(body, STRUCTS[path], structs)
    # as the engine applied them: every weight bucket arrived with the weights resident and
    # the KV cache still released, and the new weights serve the next request
    kinds = [k for k, _ in core.control_log]
    assert kinds[0] == "release" and kinds[1] == "resume" and kinds[-1] == "resume"
    loads = core.control_log[2:-1]
    assert loads and all(k == "load_weights" and tags == ("cuda_graph", "kv_cache")
                         for k, tags in loads), core.control_log
    assert out.weight_versions == [1] * 4 and out.finish_reason == "length"
    # the bytes moved: model and grads before the first step (Adam has no state yet), then
    # the model, grads and Adam's two moments (fp32 tiny-moe)
    model = first["memory/offload_model_mb"]
    assert first["memory/offload_grads_mb"] == model > 0
    assert first["memory/offload_optimizer_mb"] == 0
    assert metrics["memory/onload_bytes"] == first["memory/offload_bytes"]
    assert metrics["memory/offload_optimizer_mb"] >= 2 * model
    assert metrics["memory/offload_bytes"] == pytest.approx(
        (2 * model + metrics["memory/offload_optimizer_mb"]) * 1e6)
    assert metrics["sync/mb"] > 0
    for e in schedule.events:
        size = "" if e["bytes"] is None else f" {e['bytes'] / 1e6:.3f} MB"
        print(f"\n{e['who']:8s} {e['what']} {e['tags'] or ''}{size}", end="")
    print()


def test_an_update_into_released_weights_is_refused(initial):
    """The engine side of the order: SGLang's weights live in released memory until resumed."""
    _, hf = initial

    async def run(url: str) -> str:
        async with HttpEngine(url) as engine:
            await engine.release_memory(["weights"])
            try:
                await engine.update_weights_from_tensors(
                    [("model.norm.weight", torch.ones(64))], weight_version=2)
            except Exception as e:  # the message is the point
                return str(e)
            finally:
                await engine.resume_memory(["weights"])
            return ""

    with EmbeddedServer.from_pretrained(str(hf)).start() as server:
        message = asyncio.run(run(server.url))
        assert "weights are released" in message
        assert not server.core.released and server.core.weight_version == "0"


def test_train_loop_colocated_on_ray_moves_the_trainer_every_step(tmp_path):
    """`megatron-rl train` with the engine colocated in the trainer's bundle: every step logs
    the trainer's bytes moved, and the engine serves each step's synced weights."""
    import json

    from megatron_rl.train import train
    from tests.test_train_rl import BASE

    cfg = load_config("tiny-moe-rl-cpu", [
        *BASE, "parallel.ep=1", f"train.output_dir={tmp_path}", "checkpoint.dir=null",
        "rollout.ray=true", "rollout.layout=colocated", "rollout.trainer_ranks=1",
        "rollout.trainer_cpus=1", "rollout.engine_cpus=1", "rollout.max_restarts=1"])
    rows = train(cfg, get_pool(1))
    assert len(rows) == 2
    for row in rows:
        assert row["memory/onload_bytes"] > 0 and row["memory/offload_bytes"] > 0
        assert row["memory/offload_optimizer_mb"] > 0 and row["sync/mb"] > 0
    assert rows[1]["memory/onload_bytes"] == rows[0]["memory/offload_bytes"]
    trajs = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    for t in trajs:
        assert {v for turn in t["turns"] for v in turn["weight_versions"]} == {t["step"] - 1}
