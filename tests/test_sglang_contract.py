"""HttpEngine against SGLang 0.5.23's own schema (pinned from the released wheel's source).

A recording stub server stands in for SGLang: every request HttpEngine sends is captured off
the wire and validated against the io_struct request struct that SGLang's http_server binds to
that route (unknown keys, missing required fields, value types), /generate additionally against
SGLang's api/v1 JSON contract (whose SamplingParams rejects unknown keys). The stub's replies
are shaped like SGLang's, which also exercises the response parsing and the error paths.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import pickle
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import torch
from aiohttp import web

from megatron_rl.engines.base import (
    EngineError,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
)
from megatron_rl.engines.http_client import HttpEngine
from megatron_rl.engines.sglang_schema import TypeChecker
from megatron_rl.engines.tensors import (
    decode_safetensors,
    encode_safetensors,
    encode_torch_ipc,
    is_safetensors,
)
from tests.sglang_fixtures import load_fixture, validate_body

IO = load_fixture("io_struct")
SERVER = load_fixture("server")
STRUCTS = IO["structs"]
API = SERVER["api_v1"]

# the request structs HttpEngine must speak, by route (what 0.5.23's http_server binds)
EXPECTED_ROUTES = {
    "/generate": "GenerateReqInput",
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
}


class Stub:
    """A recording stand-in for an SGLang server, on a real socket."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.fail: dict[str, web.Response] = {}
        self.delay: dict[str, float] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        self.calls.append((request.method, request.path, body))
        if request.path in self.delay:
            await asyncio.sleep(self.delay[request.path])
        if request.path in self.fail:
            return self.fail[request.path]
        if request.path == "/generate":
            return web.json_response(self.generate_reply(body))
        if request.path == "/model_info":
            return web.json_response({"model_path": "m", "weight_version": "7"})
        if request.path in ("/health", "/abort_request", "/release_memory_occupation",
                            "/resume_memory_occupation"):
            return web.Response(status=200)
        if request.path == "/flush_cache":
            return web.Response(text="Cache flushed.\n")
        return web.json_response({"success": True, "message": "ok"})

    @staticmethod
    def generate_reply(body: dict[str, Any]) -> dict[str, Any]:
        # SGLang's shape: ids, [logprob, id, text] triples, dict finish reason, version spans
        out = [11, 12, 13]
        meta: dict[str, Any] = {
            "id": body["rid"], "finish_reason": {"type": "length", "length": 3},
            "prompt_tokens": len(body["input_ids"]), "completion_tokens": 3,
            "output_token_logprobs": [[-0.5, 11, None], [-1.5, 12, None], [-2.5, 13, None]],
            "weight_version": "5",
            "weight_versions": [{"version": "4", "start": 0, "end": 2},
                                {"version": "5", "start": 2, "end": 3}]}
        if body.get("return_routed_experts"):
            rows = len(body["input_ids"]) + len(out) - 1
            arr = np.arange(rows * 2 * 2, dtype=np.int32)
            meta["routed_experts"] = base64.b64encode(arr.tobytes()).decode()
        return {"text": "", "output_ids": out, "meta_info": meta}


async def with_stub(fn: Callable[[HttpEngine, Stub], Awaitable[None]], **engine_kw: Any) -> Stub:
    stub = Stub()
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", stub.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    engine = HttpEngine(f"http://127.0.0.1:{port}", **engine_kw)
    try:
        await fn(engine, stub)
    finally:
        await engine.close()
        await runner.cleanup()
    return stub


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 4, generator=g)),
            ("model.norm.weight", torch.randn(4, generator=g).to(torch.bfloat16)),
            ("lm_head.weight", torch.randn(16, 4, generator=g))]


async def drive_every_call(engine: HttpEngine, stub: Stub) -> None:
    """Every request the client can make, with the options that change its body."""
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=3,
                              min_new_tokens=1, stop_token_ids=[2], seed=123)
    await engine.generate(GenerateRequest("r1", [1, 2, 3], sampling))
    await engine.generate(GenerateRequest("r2", [1, 2], SamplingParams(),
                                          return_routed_experts=True))
    await engine.abort("r1")
    for mode in ("abort", "retract", "in_place"):
        await engine.pause_generation(mode)
    await engine.continue_generation()
    await engine.update_weights_from_tensors(named_tensors(), weight_version=3)
    await engine.update_weights_from_tensors([], weight_version=4)
    await engine.update_weights_from_disk("/ckpt/hf", weight_version=5)
    await engine.update_weights_from_disk("/ckpt/hf", weight_version=6, load_format="auto")
    await engine.init_weights_update_group("10.0.0.1", 29500, rank_offset=1, world_size=3)
    await engine.update_weights_from_distributed(
        ["a", "b"], [torch.bfloat16, "float32"], [[2, 3], [4]], weight_version=7)
    await engine.update_weights_from_distributed(["a"], [torch.float32], [[2]], flattened=True)
    await engine.destroy_weights_update_group()
    await engine.release_memory()
    await engine.release_memory(tags=["weights", "kv_cache"])
    await engine.resume_memory()
    await engine.resume_memory(tags=["weights"])
    await engine.flush_cache()
    assert await engine.health()
    assert await engine.get_weight_version() == 7


@pytest.fixture(scope="module")
def captured() -> list[tuple[str, str, Any]]:
    calls: list[tuple[str, str, Any]] = []
    for transport in ("safetensors", "torch_ipc"):
        for flattened in (True, False):
            # a small bucket size splits the update into several requests
            stub = asyncio.run(with_stub(drive_every_call, tensor_transport=transport,
                                         flattened=flattened, bucket_bytes=200,
                                         num_tp_payloads=2))
            calls += stub.calls
    return calls


def test_fixture_is_sglang_0_5_23() -> None:
    assert IO["sglang_version"] == SERVER["sglang_version"] == "0.5.23"
    for route, struct in EXPECTED_ROUTES.items():
        assert SERVER["routes"][route]["body"] == struct, route
        assert struct in STRUCTS


def test_every_request_body_fits_its_sglang_struct(captured: list) -> None:
    validated: set[str] = set()
    checker = TypeChecker(STRUCTS)
    for method, path, body in captured:
        route = SERVER["routes"].get(path)
        assert route is not None, f"{path}: SGLang 0.5.23 has no such route"
        assert method in route["methods"], f"{method} {path}: SGLang allows {route['methods']}"
        if route["body"] is None:
            assert not body, f"{path} takes no body in SGLang"
            continue
        errors = checker.body_errors(body or {}, route["body"])
        assert not errors, f"{method} {path}: {errors}"
        validated.add(route["body"])
    assert checker.unchecked <= {"FinishReasonDict", "WeightVersionSpans", "ReturnHiddenStatesMode",
                                 "MultimodalDataInputFormat", "SamplingLogprobsMode"}
    assert validated == set(EXPECTED_ROUTES.values())


def test_generate_body_fits_the_api_v1_contract(captured: list) -> None:
    # /generate's gate: api/v1 GenerateRequest, and SamplingParams rejects unknown keys
    assert API["structs"]["SamplingParams"]["rejects_unknown_keys"]
    bodies = [b for _, p, b in captured if p == "/generate"]
    assert bodies
    for body in bodies:
        # the gate ignores unknown top-level keys (return_routed_experts is not among its
        # fields) and rejects unknown sampling keys; GenerateReqInput above holds them all
        errors = validate_body(body, "GenerateRequest", API["structs"], API["aliases"],
                               strict=False)
        assert not errors, errors
        sp = body["sampling_params"]
        assert not validate_body(sp, "SamplingParams", API["structs"], API["aliases"])
        assert set(sp) <= set(SERVER["sampling_params"]["fields"])
    seeded = next(b for b in bodies if b["rid"] == "r1")["sampling_params"]
    assert seeded["sampling_seed"] == 123 and seeded["stop_token_ids"] == [2]


def test_the_validator_catches_what_sglang_would_refuse() -> None:
    errs = validate_body({"rid": "x", "weight_version": 3}, "AbortReq", STRUCTS)
    assert any("unknown field 'weight_version'" in e for e in errs)
    errs = validate_body({"serialized_named_tensors": ["QQ=="], "weight_version": 3},
                         "UpdateWeightsFromTensorReqInput", STRUCTS)
    assert any("weight_version" in e and "expected" in e for e in errs)  # versions are str
    errs = validate_body({"names": ["a"]}, "UpdateWeightsFromDistributedReqInput", STRUCTS)
    assert {"dtypes", "shapes"} <= {e.split("'")[1] for e in errs if "missing" in e}
    errs = validate_body({"rid": "x", "sampling_params": {"seed": 1}}, "GenerateRequest",
                         API["structs"], API["aliases"], strict=False)
    assert errs == ["SamplingParams: unknown field 'GenerateRequest.sampling_params.seed'"]


def test_weight_payloads_use_sglangs_wire_format(captured: list) -> None:
    bodies = [b for _, p, b in captured if p == "/update_weights_from_tensor"]
    assert len(bodies) > 4  # bucketed
    allowed = {tuple(g) for g in SERVER["safe_unpickler_globals"]}
    meta_fields = set(SERVER["tensor_bucket"]["FlattenedTensorMetadata"]["fields"])
    expected = dict(named_tensors())
    for body in bodies:
        assert len(body["serialized_named_tensors"]) == 2  # one per TP rank
        raw = base64.b64decode(body["serialized_named_tensors"][0])
        if is_safetensors(raw):
            got = decode_safetensors(body["serialized_named_tensors"][0])
        else:
            obj = AllowListUnpickler(io.BytesIO(raw), allowed).load()
            if body.get("load_format") == "flattened_bucket":
                # what SGLang's _update_weights_from_flattened_bucket reads off each item
                assert {"flattened_tensor", "metadata"} == set(obj)
                assert all(set(vars(m)) == meta_fields for m in obj["metadata"])
                got = [(m.name, obj["flattened_tensor"][m.start_idx:m.end_idx]
                        .view(m.dtype).reshape(m.shape)) for m in obj["metadata"]]
            else:
                got = obj
        for name, t in got:
            assert torch.equal(t, expected[name]), name
    # the version rides on the last bucket of an update only, as a string
    versions = [b.get("weight_version") for b in bodies]
    assert versions.count("3") == 4 and all(v in (None, "3") for v in versions)


class AllowListUnpickler(pickle.Unpickler):
    """SGLang's SafeUnpickler policy, from the pinned allow-list."""

    def __init__(self, f: io.BytesIO, allowed: set[tuple[str, str]]):
        super().__init__(f)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"SGLang would block {module}.{name}")
        return super().find_class(module, name)


def test_safetensors_payload_roundtrip_keeps_dtypes_and_tied_tensors() -> None:
    w = torch.randn(6, 4)
    named = [("embed.weight", w), ("lm_head.weight", w), ("n", torch.ones(3, dtype=torch.bfloat16))]
    for flattened in (True, False):
        got = dict(decode_safetensors(encode_safetensors(named, flattened)))
        assert all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in named)
    with pytest.raises(ValueError, match="pickle"):
        decode_safetensors(encode_torch_ipc(named, True))


def test_response_parsing_expands_versions_and_routed_experts() -> None:
    async def run(engine: HttpEngine, stub: Stub) -> None:
        assert isinstance(engine, RolloutEngine)
        r = await engine.generate(GenerateRequest("a", [1, 2, 3], return_routed_experts=True))
        assert r.output_ids == [11, 12, 13]
        assert r.output_logprobs == [-0.5, -1.5, -2.5]
        assert r.finish_reason == "length"
        assert r.weight_versions == [4, 4, 5]
        assert r.routed_experts.shape == (5, 2, 2)  # prompt 3 + output 3 - 1 fed positions
        await engine.update_weights_from_tensors(named_tensors(), weight_version=9)
        assert engine.weight_version == 9

    asyncio.run(with_stub(run, moe_layout=(2, 2)))


def test_errors_name_the_endpoint_and_status() -> None:
    async def run(engine: HttpEngine, stub: Stub) -> None:
        stub.fail["/update_weights_from_tensor"] = web.json_response(
            {"success": False, "message": "Failed to update parameter online"}, status=400)
        with pytest.raises(EngineError, match=r"/update_weights_from_tensor failed with HTTP 400"
                           r".*Failed to update") as e:
            await engine.update_weights_from_tensors(named_tensors(), weight_version=1)
        assert e.value.status == 400 and e.value.endpoint == "/update_weights_from_tensor"
        assert engine.weight_version == 0  # a failed update does not move the version
        stub.fail["/update_weights_from_disk"] = web.json_response(
            {"success": False, "message": "no such path"})
        with pytest.raises(EngineError, match="update_weights_from_disk was refused: no such"):
            await engine.update_weights_from_disk("/nope", 1)
        stub.delay["/generate"] = 5.0
        engine.timeout_s = 0.3
        with pytest.raises(EngineError, match=r"POST .*/generate timed out after 0.3s"):
            await engine.generate(GenerateRequest("slow", [1]))
        stub.fail["/health"] = web.Response(status=503)
        assert not await engine.health()

    asyncio.run(with_stub(run))


def test_unreachable_server_is_a_clear_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def run() -> None:
        async with HttpEngine(f"http://127.0.0.1:{port}", connect_timeout_s=2) as engine:
            with pytest.raises(EngineError, match=rf"POST http://127.0.0.1:{port}/abort_request "
                                                  r"failed: Client"):
                await engine.abort("x")
            assert not await engine.health()

    asyncio.run(run())


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")
def test_fixture_matches_the_installed_sglang() -> None:
    """On a machine with SGLang: the pinned flags and structs are the live ones."""
    import argparse
    import importlib.metadata

    if importlib.metadata.version("sglang") != SERVER["sglang_version"]:
        pytest.skip("installed sglang is another version")
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    live = {s for s in parser._option_string_actions if s.startswith("--")} - {"--help"}
    assert live == set(SERVER["server_flags"])
