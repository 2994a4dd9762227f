"""The embedded engine over real HTTP with a real (tiny, random) Qwen3-MoE, driven by HttpEngine.

Numbers are checked against transformers itself: greedy ids against `model.generate`, returned
log-probs against a full forward pass, weight updates against a reference model holding the
new weights.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import itertools
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.engines import embedded_core
from megatron_rl.engines import lean_decode as lean_decode_module
from megatron_rl.engines.base import EngineError, GenerateRequest, SamplingParams
from megatron_rl.engines.embedded import EmbeddedServer, InProcessEngine
from megatron_rl.engines.embedded_core import (
    EmbeddedCore,
    FusedRMSNorm,
    Sampling,
    Seq,
    draw_tokens,
    prefill_buckets,
)
from megatron_rl.engines.http_client import HttpEngine
from megatron_rl.engines.lean_decode import lean_decode
from megatron_rl.engines.output_layer import TransposedOutputLayer
from megatron_rl.engines.sglang_schema import TypeChecker
from megatron_rl.engines.tensors import encode_safetensors
from megatron_rl.models.registry import get_model_spec
from tests.sglang_fixtures import load_fixture

PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [301, 4, 88], [12, 250, 251, 9, 10]]
TOL = 1e-5

SENTENCES = [
    "the agent searches the web and reads the page",
    "a judge compares the answer with the reference answer",
    "system user assistant tool observation result",
    "summarize the page in one short sentence please",
]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")


def tiny_model(seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = get_model_spec("tiny-moe").hf_config()
    return AutoModelForCausalLM.from_config(cfg).float().eval()


def tiny_tokenizer() -> Any:
    """A WordLevel tokenizer trained here on a few sentences, with a ChatML template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<|im_end|>")
    fast.chat_template = CHATML
    return fast


def perturbed(model: torch.nn.Module, seed: int = 1, scale: float = 0.05) -> torch.nn.Module:
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return ref


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def greedy(max_new: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, **kw)


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def full_logprobs(model: torch.nn.Module, prompt: list[int], out: list[int],
                  temperature: float = 1.0) -> list[float]:
    logits = model(torch.tensor([prompt + out])).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model()


@pytest.fixture(scope="module")
def server(model: torch.nn.Module):
    with EmbeddedServer(model, model_path="tiny-moe").start() as s:
        yield s


async def generate(url: str, *reqs: GenerateRequest, **kw: Any) -> list:
    async with HttpEngine(url, **kw) as eng:
        return list(await asyncio.gather(*(eng.generate(r) for r in reqs)))


async def server_info(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/server_info") as r:
        return await r.json()


async def wait_running(url: str, rid: str, n: int) -> int:
    for _ in range(2000):
        got = (await server_info(url))["running"].get(rid, 0)
        if got >= n:
            return got
        await asyncio.sleep(0.005)
    raise AssertionError(f"{rid} never reached {n} tokens")


# ---------------------------------------------------------------------------------------------


def test_greedy_matches_hf_generate_and_logprobs_match_a_full_forward(model, server) -> None:
    reqs = [GenerateRequest(f"g{i}", p, greedy(24)) for i, p in enumerate(PROMPTS)]
    for req, res in zip(reqs, run(generate(server.url, *reqs))):
        assert res.output_ids == hf_greedy(model, req.input_ids, 24)
        assert res.finish_reason == "length" and res.weight_versions == [0] * 24
        # greedy log-probs are those of the raw logits (SGLang: temperature 1 when greedy)
        assert max_diff(res.output_logprobs, full_logprobs(model, req.input_ids,
                                                           res.output_ids)) < TOL


def test_sampled_logprobs_follow_sglangs_temperature_convention(model, server) -> None:
    for temp in (1.0, 0.7):
        req = GenerateRequest("t", PROMPTS[0], SamplingParams(temperature=temp, seed=3,
                                                              max_new_tokens=16))
        (res,) = run(generate(server.url, req))
        expected = full_logprobs(model, req.input_ids, res.output_ids, temperature=temp)
        assert max_diff(res.output_logprobs, expected) < TOL
    with EmbeddedServer(model, return_original_logprob=True).start() as raw:
        (res,) = run(generate(raw.url, req))
        assert max_diff(res.output_logprobs, full_logprobs(model, req.input_ids,
                                                           res.output_ids)) < TOL


def test_seeded_sampling_is_reproducible(server) -> None:
    def sample(seed: int | None, rid: str, **kw: Any) -> list[int]:
        req = GenerateRequest(rid, PROMPTS[1], SamplingParams(seed=seed, max_new_tokens=20, **kw))
        return run(generate(server.url, req))[0].output_ids

    assert sample(7, "s1") == sample(7, "s2")
    assert sample(7, "s3") != sample(8, "s4")
    # top_k=1 and a vanishing top_p both leave only the argmax
    top = run(generate(server.url, GenerateRequest("s5", PROMPTS[1], greedy(20))))[0].output_ids
    assert sample(None, "s6", top_k=1) == top
    assert sample(None, "s7", top_p=1e-6) == top
    assert sample(None, "s8", top_p=1e-97) == top  # 0.0 in float32: still the argmax


def test_sampled_tokens_follow_the_softmax_and_its_truncations() -> None:
    """The sampler without a sort (no top-k/top-p) and with one draw what the softmax says."""
    n = 6000
    probs = torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")]) / 0.7, -1)

    def freq(**kw: Any) -> torch.Tensor:
        gens = [torch.Generator().manual_seed(i) for i in range(n)]
        toks = draw_tokens(probs.expand(n, -1), [Sampling(temperature=0.7, **kw)] * n, gens)
        return torch.bincount(toks, minlength=6) / n

    free = freq(top_k=-1)
    assert (free - probs).abs().max() < 0.025 and free[5] == 0  # p = 0: never
    top2 = freq(top_k=2)
    assert (top2[:2] - probs[:2] / probs[:2].sum()).abs().max() < 0.025 and top2[2:].sum() == 0
    # top-p: the smallest prefix whose mass reaches 0.8 (p[0] = 0.66 alone does not)
    assert probs[0] < 0.8 <= probs[:2].sum()
    assert freq(top_p=0.8)[2:].sum() == 0
    # a row of the batch draws from its own generator: the same token alone or among others
    mixed = [Sampling(temperature=0.7, top_k=2 if i % 2 else 6) for i in range(8)]
    together = draw_tokens(probs.expand(8, -1), mixed, [torch.Generator().manual_seed(i)
                                                          for i in range(8)])
    alone = [draw_tokens(probs[None], [sp], [torch.Generator().manual_seed(i)])[0]
             for i, sp in enumerate(mixed)]
    assert together.tolist() == [int(t) for t in alone]


def test_concurrent_requests_match_their_sequential_results(server) -> None:
    # different prompt and output lengths: rows join and leave the batch at different steps
    reqs = [GenerateRequest(f"c{i}", PROMPTS[i % 3][: 3 + i % 4],
                            SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i,
                                           max_new_tokens=6 + 5 * i))
            for i in range(6)]
    sequential = [run(generate(server.url, r))[0] for r in reqs]
    together = run(generate(server.url, *[dataclasses.replace(r, rid=r.rid + "x") for r in reqs]))
    for a, b in zip(sequential, together):
        assert a.output_ids == b.output_ids
        assert max_diff(a.output_logprobs, b.output_logprobs) < TOL
    assert run(server_info(server.url))["max_running"] > 1  # they really were batched


def test_stop_tokens_and_min_new_tokens(model, server) -> None:
    plain = hf_greedy(model, PROMPTS[0], 30)
    stop = plain[5]
    for min_new in (0, 8):  # HF's eos handling has the same semantics: stop token kept
        with torch.no_grad():
            ref = model.generate(torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=30,
                                 min_new_tokens=min_new, eos_token_id=stop, pad_token_id=0)
        ref = ref[0, len(PROMPTS[0]):].tolist()
        (res,) = run(generate(server.url, GenerateRequest(
            f"st{min_new}", PROMPTS[0], greedy(30, stop_token_ids=[stop],
                                               min_new_tokens=min_new))))
        assert res.output_ids == ref
        assert stop not in res.output_ids[:min_new]
        if res.output_ids[-1] == stop:
            assert res.finish_reason == "stop"
            assert res.meta_info["finish_reason"]["matched"] == stop
    (res,) = run(generate(server.url, GenerateRequest("st", PROMPTS[0],
                                                      greedy(30, stop_token_ids=[stop]))))
    assert res.output_ids == plain[: plain.index(stop) + 1] and res.finish_reason == "stop"


@pytest.fixture(scope="module")
def long_ref(model) -> dict[int, list[int]]:
    """Greedy continuations long enough that abort/pause land mid-generation."""
    return {i: hf_greedy(model, PROMPTS[i], LONG) for i in (0, 2)}


LONG = 200


def test_abort_returns_the_partial_output_and_resuming_continues_it(server, long_ref) -> None:
    ref = long_ref[2]

    async def scenario() -> tuple:
        async with HttpEngine(server.url) as eng:
            task = asyncio.create_task(eng.generate(GenerateRequest("ab", PROMPTS[2],
                                                                    greedy(LONG))))
            await wait_running(server.url, "ab", 4)
            await eng.abort("ab")
            partial = await task
            await eng.abort("no-such-rid")  # unknown ids are fine, as in SGLang
            rest = await eng.generate(GenerateRequest("ab2", PROMPTS[2] + partial.output_ids,
                                                      greedy(LONG - len(partial.output_ids))))
            return partial, rest

    partial, rest = run(scenario())
    assert partial.finish_reason == "abort"
    assert 4 <= len(partial.output_ids) < LONG
    assert len(partial.output_logprobs) == len(partial.weight_versions) == len(partial.output_ids)
    assert partial.output_ids + rest.output_ids == ref  # resumed from the committed prefix


async def cut_and_resume(eng: HttpEngine, url: str, rid: str) -> tuple:
    """A long call cancelled after 4 tokens, then the same rid sent again for 8: (what the
    server still runs right after the cancel, the second call's result)."""
    task = asyncio.create_task(eng.generate(GenerateRequest(rid, PROMPTS[2], greedy(LONG))))
    await wait_running(url, rid, 4)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    running = (await server_info(url))["running"]
    return running, await eng.generate(GenerateRequest(rid, PROMPTS[2], greedy(8)))


def test_a_cancelled_client_call_aborts_its_request_on_the_server(server, long_ref) -> None:
    """Partial rollout cancels sessions at a step cut: the server must stop decoding them and
    free their rid, which the resumed session sends again."""

    async def scenario() -> tuple:
        async with HttpEngine(server.url) as eng:
            return await cut_and_resume(eng, server.url, "cut")

    running, again = run(scenario())
    assert "cut" not in running
    assert again.output_ids == long_ref[2][:8]


def test_the_in_process_client_answers_as_http_does(server, long_ref) -> None:
    """The driver's client of its own embedded engine skips HTTP for generate: the same
    results (log-probs to rounding), the same errors (EngineError with the route's status
    and the field), and a cancelled call's rid is free when the cancel returns."""
    reqs = [GenerateRequest(f"ip{i}", p, greedy(12)) for i, p in enumerate(PROMPTS)]

    async def scenario() -> tuple:
        async with InProcessEngine(server) as here, HttpEngine(server.url) as http:
            local = await asyncio.gather(*(here.generate(r) for r in reqs))
            remote = await asyncio.gather(*(http.generate(r) for r in reqs))
            with pytest.raises(EngineError, match="token id 99999 is outside") as bad:
                await here.generate(GenerateRequest("bad", [1, 99999], greedy(2)))
            running, again = await cut_and_resume(here, server.url, "ipcut")
            return local, remote, bad.value, running, again

    local, remote, bad, running, again = run(scenario())
    # the same tokens; log-probs to rounding: the second run's prompts may hit the prefixes
    # the first one cached, or join another batch (either way ~1e-6 apart)
    for a, b in zip(local, remote, strict=True):
        assert (a.output_ids, a.finish_reason, a.weight_versions) == (
            b.output_ids, b.finish_reason, b.weight_versions)
        assert max_diff(a.output_logprobs, b.output_logprobs) < TOL
    assert bad.status == 400 and bad.endpoint == "/generate"
    assert "ipcut" not in running
    assert again.output_ids == long_ref[2][:8]


def test_pause_holds_requests_and_continue_finishes_them(server, long_ref) -> None:
    ref = long_ref[0]

    async def scenario(mode: str) -> tuple:
        async with HttpEngine(server.url) as eng:
            task = asyncio.create_task(eng.generate(GenerateRequest(f"p-{mode}", PROMPTS[0],
                                                                    greedy(LONG))))
            await wait_running(server.url, f"p-{mode}", 3)
            await eng.pause_generation(mode)
            late = asyncio.create_task(eng.generate(GenerateRequest(f"late-{mode}", PROMPTS[0],
                                                                    greedy(5))))
            first = await server_info(server.url)
            await asyncio.sleep(0.3)
            second = await server_info(server.url)
            await eng.continue_generation()
            return first, second, await task, await late

    first, second, held, late = run(scenario("in_place"))
    assert first["paused"] and first["running"] == second["running"]  # no decode while paused
    assert "p-in_place" in first["running"] and "late-in_place" in second["waiting"]
    assert held.output_ids == ref and late.output_ids == ref[:5]
    first, second, held, _ = run(scenario("retract"))
    assert first["running"] == {} and "p-retract" in first["waiting"]
    assert held.output_ids == ref  # recomputed from prompt + output after continue
    first, _, held, late = run(scenario("abort"))
    assert held.finish_reason == "abort" and held.output_ids == ref[: len(held.output_ids)]
    assert late.output_ids == ref[:5]


def checkpoint_tensors(model: torch.nn.Module, path: Path) -> list[tuple[str, torch.Tensor]]:
    """The HF checkpoint names (per-expert tensors, as SGLang and the trainer use them)."""
    model.save_pretrained(path)
    return list(load_file(path / "model.safetensors").items())


def test_weight_update_from_tensors_gives_the_new_models_numbers(model, tmp_path) -> None:
    ref = perturbed(model)
    named = checkpoint_tensors(ref, tmp_path / "new")
    assert any(".experts.0.gate_proj.weight" in n for n, _ in named)
    with EmbeddedServer(copy.deepcopy(model)).start() as srv:
        async def scenario() -> tuple:
            # small buckets: the update spans many requests; the version moves with the last
            async with HttpEngine(srv.url, bucket_bytes=64 << 10) as eng:
                before = await eng.generate(GenerateRequest("w0", PROMPTS[0], greedy(12)))
                await eng.update_weights_from_tensors(named, weight_version=1)
                after = await eng.generate(GenerateRequest("w1", PROMPTS[0], greedy(12)))
                version = await eng.get_weight_version()
                await eng.update_weights_from_disk(str(tmp_path / "old"), weight_version=2)
                back = await eng.generate(GenerateRequest("w2", PROMPTS[0], greedy(12)))
                return before, after, version, back

        model.save_pretrained(tmp_path / "old")
        before, after, version, back = run(scenario())
    assert before.weight_versions == [0] * 12 and after.weight_versions == [1] * 12
    assert version == 1
    assert after.output_ids == hf_greedy(ref, PROMPTS[0], 12) != before.output_ids
    assert max_diff(after.output_logprobs, full_logprobs(ref, PROMPTS[0], after.output_ids)) < TOL
    assert back.output_ids == before.output_ids and back.weight_versions == [2] * 12
    assert max_diff(back.output_logprobs, before.output_logprobs) < TOL


def test_weight_update_mid_generation_is_recorded_per_token(model, tmp_path) -> None:
    named = checkpoint_tensors(perturbed(model), tmp_path)
    with EmbeddedServer(copy.deepcopy(model)).start() as srv:
        async def scenario() -> Any:
            async with HttpEngine(srv.url) as eng:
                task = asyncio.create_task(eng.generate(GenerateRequest("mid", PROMPTS[1],
                                                                        greedy(400))))
                await wait_running(srv.url, "mid", 5)
                await eng.update_weights_from_tensors(named, weight_version=7)
                return await task

        res = run(scenario())
    switch = res.weight_versions.index(7)
    assert switch >= 5 and res.weight_versions == [0] * switch + [7] * (400 - switch)
    assert [s["version"] for s in res.meta_info["weight_versions"]] == ["0", "7"]


def test_bad_tensors_are_rejected_by_name_and_the_old_weights_stay(model, tmp_path) -> None:
    good = checkpoint_tensors(perturbed(model), tmp_path)
    with EmbeddedServer(copy.deepcopy(model)).start() as srv:
        async def scenario() -> tuple:
            async with HttpEngine(srv.url) as eng:
                before = await eng.generate(GenerateRequest("b0", PROMPTS[0], greedy(10)))
                with pytest.raises(EngineError, match=r"HTTP 400.*unknown tensor "
                                   r"'model.layers.0.mlp.experts.9.gate_proj.weight'") as e1:
                    await eng.update_weights_from_tensors(
                        [*good[:3], ("model.layers.0.mlp.experts.9.gate_proj.weight",
                                     torch.zeros(64, 64))], weight_version=1)
                bad_shape = ("model.layers.1.self_attn.k_proj.weight", torch.zeros(64, 64))
                with pytest.raises(EngineError, match=r"tensor 'model.layers.1.self_attn.k_proj"
                                   r".weight': expected shape \[32, 64\] but found \[64, 64\]"):
                    await eng.update_weights_from_tensors([*good, bad_shape], weight_version=1)
                with pytest.raises(EngineError, match="weight_version"):
                    await eng.request("POST", "/update_weights_from_tensor", {
                        "serialized_named_tensors": [encode_safetensors(good[:1], True)],
                        "weight_version": "v1"})
                with pytest.raises(EngineError, match="payload is not a safetensors file"):
                    await eng.request("POST", "/update_weights_from_tensor", {
                        "serialized_named_tensors": ["AAAA"]})
                after = await eng.generate(GenerateRequest("b1", PROMPTS[0], greedy(10)))
                return e1.value, before, after

        err, before, after = run(scenario())
    assert err.status == 400 and err.endpoint == "/update_weights_from_tensor"
    assert after.output_ids == before.output_ids and after.weight_versions == [0] * 10
    assert max_diff(after.output_logprobs, before.output_logprobs) == 0.0


def test_update_from_an_incomplete_disk_checkpoint_is_refused(model, tmp_path) -> None:
    from safetensors.torch import save_file

    named = dict(checkpoint_tensors(model, tmp_path / "full"))
    (tmp_path / "part").mkdir()
    save_file({k: v for k, v in named.items() if "layers.1." not in k},
              tmp_path / "part" / "model.safetensors")
    with EmbeddedServer(copy.deepcopy(model)).start() as srv:
        async def scenario() -> None:
            async with HttpEngine(srv.url) as eng:
                with pytest.raises(EngineError, match=r"leaves \d+ weights unset, e.g. "
                                                      r"'model.layers.1"):
                    await eng.update_weights_from_disk(str(tmp_path / "part"), 1)
                with pytest.raises(EngineError, match="no \\*.safetensors files"):
                    await eng.update_weights_from_disk(str(tmp_path / "nothing"), 1)
                assert await eng.get_weight_version() == 0

        run(scenario())


def test_release_refuses_generation_until_resume(server) -> None:
    async def scenario() -> Any:
        async with HttpEngine(server.url) as eng:
            await eng.release_memory()
            with pytest.raises(EngineError, match=r"HTTP 503.*memory is released"):
                await eng.generate(GenerateRequest("r0", PROMPTS[0], greedy(3)))
            assert await eng.health()
            await eng.resume_memory()
            await eng.flush_cache()
            return await eng.generate(GenerateRequest("r1", PROMPTS[0], greedy(3)))

    assert run(scenario()).finish_reason == "length"


def test_routed_experts_are_the_routers_top_k(model, server) -> None:
    req = GenerateRequest("re", PROMPTS[1], greedy(6), return_routed_experts=True)
    (res,) = run(generate(server.url, req, moe_layout=(2, 2)))
    fed = PROMPTS[1] + res.output_ids[:-1]
    assert res.routed_experts.shape == (len(fed), 2, 2)
    with torch.no_grad():
        logits = model(torch.tensor([fed]), output_router_logits=True).router_logits
    expected = np.stack([torch.topk(r, 2, -1).indices.numpy() for r in logits], axis=1)
    assert np.array_equal(np.sort(res.routed_experts, -1), np.sort(expected, -1))


def test_malformed_requests_get_400_naming_the_field(server) -> None:
    cases = [
        ({"rid": "m", "sampling_params": {}}, "input_ids: required"),
        ({"input_ids": "1 2 3"}, "input_ids: expected a non-empty list of token ids"),
        ({"input_ids": [1, 2.5]}, "input_ids: expected a non-empty list"),
        ({"input_ids": [1, 99999]}, "input_ids: token id 99999 is outside the vocabulary"),
        ({"input_ids": [1], "sampling_params": {"temperature": "hot"}},
         "sampling_params.temperature: expected float"),
        ({"input_ids": [1], "sampling_params": {"seed": 1}},
         "sampling_params.seed: not supported"),
        ({"input_ids": [1], "rid": 5}, "rid: expected a string"),
        ({"input_ids": [1], "stream": True}, "stream: streaming is not supported"),
        ([1, 2], "request body: expected a JSON object"),
    ]

    async def scenario() -> None:
        async with aiohttp.ClientSession() as s:
            for body, message in cases:
                async with s.post(server.url + "/generate", json=body) as r:
                    assert r.status == 400, body
                    assert message in (await r.json())["error"]["message"], body
            async with s.post(server.url + "/generate", data=b"{not json") as r:
                assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]

    run(scenario())


def test_responses_fit_sglangs_api_v1_contract(server) -> None:
    api = load_fixture("server")["api_v1"]
    checker = TypeChecker(api["structs"], api["aliases"], strict=False)

    async def scenario() -> dict:
        body = {"rid": "c", "input_ids": PROMPTS[0], "return_logprob": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        async with aiohttp.ClientSession() as s, s.post(server.url + "/generate", json=body) as r:
            return await r.json()

    data = run(scenario())
    assert checker.body_errors(data, "GenerateResponse") == []
    assert checker.body_errors(data["meta_info"], "GenerateMetaInfo") == []
    assert set(data["meta_info"]) >= {"id", "finish_reason", "output_token_logprobs",
                                      "weight_version", "prompt_tokens", "completion_tokens"}


def test_chat_completions_serve_as_a_judge(model) -> None:
    tok = tiny_tokenizer()
    messages = [{"role": "system", "content": "the judge compares the answer"},
                {"role": "user", "content": "summarize the page please"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    expected = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    with EmbeddedServer(model, tok).start() as srv:
        async def scenario() -> tuple:
            async with HttpEngine(srv.url) as eng:
                text = await eng.chat(messages, max_tokens=8)
            from openai import AsyncOpenAI

            client = AsyncOpenAI(base_url=srv.url + "/v1", api_key="none")
            resp = await client.chat.completions.create(model="judge", messages=messages,
                                                        max_tokens=8, temperature=0)
            await client.close()
            return text, resp

        text, resp = run(scenario())
    assert text == expected and isinstance(text, str)
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_cli_serves_a_model_directory(model, tmp_path) -> None:
    from megatron_rl.engines.kinds import EngineSpec

    model.save_pretrained(tmp_path)
    spec = EngineSpec(model_path=str(tmp_path), threads=1, prefix_cache=False)
    argv, _, _ = spec.engine_kind().command(spec, "127.0.0.1", 0)
    assert "--no-prefix-cache" in argv  # rollout.prefix_cache=false reaches the server
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        (res,) = run(generate(url, GenerateRequest("cli", PROMPTS[0], greedy(8))))
        assert res.output_ids == hf_greedy(model, PROMPTS[0], 8)
        assert run(server_info(url))["prefix_cache"] is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_model_failure_fails_its_requests_not_the_server(model) -> None:
    with EmbeddedServer(model).start() as srv:
        forward = srv.core._forward

        def broken(*args: Any, **kw: Any) -> Any:
            raise RuntimeError("simulated kernel failure")

        srv.core._forward = broken
        with pytest.raises(EngineError, match=r"HTTP 500.*RuntimeError: simulated kernel failure"):
            run(generate(srv.url, GenerateRequest("f0", PROMPTS[0], greedy(4))))
        srv.core._forward = forward
        (res,) = run(generate(srv.url, GenerateRequest("f1", PROMPTS[0], greedy(4))))
        assert res.output_ids == hf_greedy(model, PROMPTS[0], 4)


def test_aborting_a_waiting_request_returns_it_empty(server) -> None:
    async def scenario() -> Any:
        async with HttpEngine(server.url, moe_layout=(2, 2)) as eng:
            await eng.pause_generation("in_place")
            task = asyncio.create_task(eng.generate(GenerateRequest(
                "w", PROMPTS[0], greedy(4), return_routed_experts=True)))
            while "w" not in (await server_info(server.url))["waiting"]:
                await asyncio.sleep(0.01)
            await eng.abort("w")
            await eng.continue_generation()
            return await task

    res = run(scenario())
    assert (res.finish_reason, res.output_ids, res.weight_versions) == ("abort", [], [])
    assert res.routed_experts.shape == (0, 2, 2)


def test_the_qwen3_5_hybrid_batches_its_recurrent_states() -> None:
    """Gated DeltaNet layers keep per-row conv/recurrent states, not a KV cache: rows joining
    and leaving a running batch keep them aligned, so greedy outputs equal transformers'
    `generate` of each prompt alone (the hybrid used to fail with an IndexError)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(get_model_spec("tiny-qwen3.5").hf_config()).eval()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3] * 11]
    lengths = [12, 5, 9]
    server = EmbeddedServer(model, max_batch_size=4).start()

    async def run() -> list[list[int]]:
        engine = HttpEngine(server.url)
        try:
            return [r.output_ids for r in await asyncio.gather(*(
                engine.generate(GenerateRequest(f"h{i}", p, SamplingParams(
                    max_new_tokens=n, temperature=0.0)))
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))))]
        finally:
            await engine.close()

    try:
        got = asyncio.run(run())
    finally:
        server.stop()
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                               min_new_tokens=n)[0, len(p):].tolist()
                for p, n in zip(prompts, lengths, strict=True)]
    assert got == want


# ---------------------------------------------------------------------------------------------
# the core driven directly (no HTTP): continuous batching against `generate`


def hf_model(name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(get_model_spec(name).hf_config()).float().eval()


def mixed_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def core_seq(rid: str, prompt: list[int], n: int) -> Seq:
    return Seq(rid=rid, prompt=list(prompt), sampling=Sampling(temperature=0.0, max_new_tokens=n),
               return_logprob=True, return_routed=False, future=concurrent.futures.Future())


@torch.no_grad()
def left_padded_generate(model: torch.nn.Module, prompts: list[list[int]], n: int
                         ) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=0)
    return out[:, width:].tolist()


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense", "tiny-qwen3.5"])
def test_core_greedy_equals_generate_on_a_mixed_length_batch(name: str) -> None:
    """All prompts submitted at once, as benchmarks/engine_vs_generate.py does: prefilled in
    length buckets, decoded as one batch; every output equals `generate`'s on the left-padded
    batch and on its prompt alone."""
    model = hf_model(name)
    prompts, n = mixed_prompts(10, 2, 120, seed=1), 12
    assert len(prefill_buckets(list(map(len, prompts)), embedded_core.PREFILL_CALL_TOKENS)) > 1
    core = EmbeddedCore(model)
    core.start()
    try:
        seqs = [core_seq(f"m{i}", p, n) for i, p in enumerate(prompts)]
        for s in seqs:
            core.submit(s)
        got = [s.future.result(timeout=300)["output_ids"] for s in seqs]
    finally:
        core.stop()
    assert core.max_running == len(prompts)
    assert got == left_padded_generate(model, prompts, n)
    assert got == [hf_greedy(model, p, n) for p in prompts]


@pytest.mark.parametrize(("name", "attention"), [
    ("tiny-moe", "bias"), ("tiny-moe", "mask4d"), ("tiny-moe", "mask2d"),
    ("tiny-qwen3.5", "mask4d")])
def test_rows_joining_and_leaving_a_running_batch_keep_generates_outputs(
        name: str, attention: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests join a running batch with prompts longer and shorter than its width, wait for
    a free row, leave at different steps and outgrow the cache's spare columns; each output
    still equals `generate` of its prompt alone, whichever way padding reaches attention."""
    monkeypatch.setattr(embedded_core, "SLAB_SPARE", 3)  # slabs run out of columns: they grow
    model = hf_model(name)
    core = EmbeddedCore(model, max_batch_size=4)
    assert embedded_core.attention_mode(model) == ("mask4d" if "3.5" in name else "bias")
    core.attention = attention
    prompts = mixed_prompts(8, 2, 70, seed=2)
    lengths = [4 + 3 * i for i in range(8)]
    seqs = [core_seq(f"j{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lengths))]
    with torch.no_grad():
        core.pending.extend(seqs[:2])
        for _ in range(3):
            core.step()
        core.pending.extend(seqs[2:])
        while core.batch or core.pending:
            core.step()
    for s, p, n in zip(seqs, prompts, lengths, strict=True):
        assert s.future.result(timeout=0)["output_ids"] == hf_greedy(model, p, n)
        assert max_diff(s.logprobs, full_logprobs(model, p, s.out)) < TOL
    assert core.max_running == 4 and core.cache is None and core.width == 0


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-qwen3.5"])
def test_the_engine_runs_each_rms_norm_as_one_op_with_the_same_outputs(name: str) -> None:
    """The engine swaps the norms whose fused op matches bit for bit (Qwen3's w and Qwen3.5's
    1 + w); the parameters keep their names and storage, the logits stay exactly HF's, and
    Qwen3.5's gated norm (another formula) stays as it is."""
    model = hf_model(name)
    with torch.no_grad():  # gammas away from their init, so w and 1 + w differ
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    reference = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    core = EmbeddedCore(model)
    fused = {n: m for n, m in model.named_modules() if isinstance(m, FusedRMSNorm)}
    kept = {type(m).__name__ for m in model.modules() if not isinstance(m, FusedRMSNorm)
            and type(m).__name__.endswith(("RMSNorm", "RMSNormGated"))}
    assert core.fused_norms == len(fused) == (9 if name == "tiny-moe" else 11)
    assert {m.offset for m in fused.values()} == ({0.0} if name == "tiny-moe" else {1.0})
    assert kept == (set() if name == "tiny-moe" else {"Qwen3_5MoeRMSNormGated"})
    assert [n for n, _ in model.named_parameters()] == names
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage
    ids = torch.tensor([mixed_prompts(1, 40, 40, seed=3)[0]] * 2)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("tied", [False, True])
def test_the_engine_computes_logits_from_a_transposed_output_layer(tied: bool, monkeypatch
                                                                   ) -> None:
    """With `fast_output_layer` the engine swaps `lm_head` for the transposed layer: the same
    Parameter (name, storage, tying), logits bit for bit F.linear's from 4 rows on (at any
    thread count: MKL's split differs from the copy's at 5-11 rows on two threads) and within
    float rounding below, the copy rebuilt after a weight load (by either engine on a shared
    model); without it, or for a layer too large to copy, `lm_head` stays nn.Linear."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = get_model_spec("tiny-moe").hf_config()
    cfg.vocab_size, cfg.tie_word_embeddings = 2048, tied
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    weight = model.lm_head.weight
    assert EmbeddedCore(model).output_layer is None  # off by default: F.linear's bits
    assert type(model.lm_head) is torch.nn.Linear
    core = EmbeddedCore(model, threads=2, fast_output_layer=True)
    assert isinstance(model.lm_head, TransposedOutputLayer) and core.output_layer is model.lm_head
    assert model.lm_head.weight is weight
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            for n_threads, rows in itertools.product((1, 2), (1, 2, 3, 4, 5, 7, 16, 33)):
                torch.set_num_threads(n_threads)
                x = torch.randn(rows, cfg.hidden_size)
                want = torch.nn.functional.linear(x, weight)
                got = model.lm_head(x)
                assert got.shape == (rows, 2048)
                if rows >= 4:
                    assert torch.equal(got, want), (n_threads, rows)
                else:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.set_num_threads(1)
            x = torch.randn(3, 1, cfg.hidden_size)  # a prefill's [rows, 1, hidden]
            torch.testing.assert_close(model.lm_head(x), torch.nn.functional.linear(x, weight))
            other = EmbeddedCore(model, threads=1)  # on the same model, without asking for it
            assert other.output_layer is None
            for engine in (core, other):
                new = torch.randn(2048, cfg.hidden_size)
                engine.load_weights([("lm_head.weight", new)], None)
                x = torch.randn(8, cfg.hidden_size)
                assert torch.equal(model.lm_head(x), torch.nn.functional.linear(x, new))
            weight.add_(1.0)  # written in place outside the engine (as a test's reference is)
            assert torch.equal(model.lm_head(x), torch.nn.functional.linear(x, weight))
            twin = copy.deepcopy(model)
            twin.lm_head.weight.mul_(2.0)
            assert torch.equal(twin.lm_head(x), torch.nn.functional.linear(x, 2 * weight))
    finally:
        torch.set_num_threads(threads)
    x = torch.randn(5, cfg.hidden_size, requires_grad=True)  # training the model still works
    model.lm_head(x).sum().backward()
    assert weight.grad is not None and x.grad is not None
    monkeypatch.setattr("megatron_rl.engines.output_layer.MAX_COPY_BYTES", 1024)
    plain = hf_model("tiny-moe")
    assert EmbeddedCore(plain, fast_output_layer=True).output_layer is None
    assert type(plain.lm_head) is torch.nn.Linear


def test_a_norm_of_another_formula_is_not_fused() -> None:
    """Only the probe decides: a module named like an RMSNorm that adds eps outside the root
    is left alone."""

    class OddRMSNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(8)), 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6)

    net = torch.nn.Sequential(OddRMSNorm())
    assert embedded_core.fuse_rms_norms(net) == 0 and isinstance(net[0], OddRMSNorm)
    model = hf_model("tiny-moe")
    assert embedded_core.fuse_rms_norms(model) == 9
    assert embedded_core.fuse_rms_norms(model) == 0  # once is enough


@pytest.mark.parametrize("name,gated_delta,moe", [("tiny-moe", 0, 2), ("tiny-qwen3.5", 3, 4)])
def test_decode_steps_run_the_layers_directly_only_where_that_is_exactly_the_model(
        name: str, gated_delta: int, moe: int) -> None:
    """Decode steps run the model's own modules in order, skipping the forward wrappers, the
    hybrid's Gated DeltaNet layers through the engine's single-step kernel and every MoE
    block through `sparse_moe_decode`, and still write exactly `generate`'s tokens (padded
    rows joining and leaving); a model whose lean path differs by a rounding is left on its
    own forward, a part at a time."""
    model = hf_model(name)
    core = EmbeddedCore(model, max_batch_size=4)
    assert core.decode_step is not None
    assert core.decode_step.gated_delta_layers == gated_delta
    assert core.decode_step.moe_blocks == moe
    with pytest.MonkeyPatch.context() as mp:  # a lean MoE that rounds otherwise
        sparse_moe_decode = lean_decode_module.sparse_moe_decode
        mp.setattr(lean_decode_module, "sparse_moe_decode",
                   lambda block, h: sparse_moe_decode(block, h) + 1e-6)
        step = lean_decode(model, core.attention)
        assert step.moe_blocks == 0 and step.gated_delta_layers == gated_delta
    calls = []
    lean = core.decode_step
    core.decode_step = lambda *a, **k: calls.append(a[0].shape[0]) or lean(*a, **k)
    prompts = mixed_prompts(6, 2, 40, seed=5)
    seqs = [core_seq(f"l{i}", p, 5 + i) for i, p in enumerate(prompts)]
    with torch.no_grad():
        core.pending.extend(seqs)
        while core.batch or core.pending:
            core.step()
    assert [s.future.result(timeout=0)["output_ids"] for s in seqs] == [
        hf_greedy(model, p, 5 + i) for i, p in enumerate(prompts)]
    assert len(calls) >= 9 and max(calls) == 4  # every decode step, up to the full batch
    if gated_delta:  # transformers' decode kernel rounding otherwise: its own layers
        import transformers.integrations.sdpa_attention as sdpa
        import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as qwen35

        # the full-attention layer takes the padding as a bias: sdpa's grouped-query kernel,
        # no copy of the cache's KV heads per step (as with a mask)
        assert lean.as_bias
        repeats = []
        with pytest.MonkeyPatch.context() as mp:
            repeat_kv = sdpa.repeat_kv
            mp.setattr(sdpa, "repeat_kv", lambda *a: repeats.append(1) or repeat_kv(*a))
            seqs = [core_seq(f"r{i}", p, 4) for i, p in enumerate(prompts[:3])]
            core.pending.extend(seqs)
            with torch.no_grad():
                core.step()  # the prefill passes a mask (its rows hold padding)
                prefilled = len(repeats)
                while core.batch:
                    core.step()
        assert prefilled and len(repeats) == prefilled
        with pytest.MonkeyPatch.context() as mp:
            update = qwen35.causal_conv1d_update
            mp.setattr(qwen35, "causal_conv1d_update", lambda *a, **k: update(*a, **k) + 1e-6)
            assert lean_decode(model, "mask4d").gated_delta_layers == 0
        with pytest.MonkeyPatch.context() as mp:  # the grouped-query kernel rounds otherwise
            fn = torch.nn.functional.scaled_dot_product_attention
            mp.setattr(torch.nn.functional, "scaled_dot_product_attention",
                       lambda *a, enable_gqa=False, **k: fn(*a, enable_gqa=enable_gqa, **k)
                       + (1e-6 if enable_gqa else 0.0))
            step = lean_decode(model, "mask4d")
            assert not step.as_bias and step.gated_delta_layers == gated_delta
        return

    class SkewedHead(torch.nn.Linear):  # differs from the model's path on 2-D input only
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + (1e-6 if x.dim() == 2 else 0.0)

    odd = hf_model("tiny-moe")
    head = SkewedHead(odd.lm_head.in_features, odd.lm_head.out_features, bias=False)
    head.weight = odd.lm_head.weight
    odd.lm_head = head
    assert lean_decode(odd) is None
    assert EmbeddedCore(odd).decode_step is None


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-qwen3.5"])
def test_one_token_prompts_prefill_through_the_model(name: str) -> None:
    """A one-token prompt's prefill is one token per row too, but on a cache that holds
    nothing yet: the model's forward runs it (the decode step reads recurrent states that
    only a prefill writes), and the tokens are `generate`'s."""
    model = hf_model(name)
    core = EmbeddedCore(model, max_batch_size=4)
    seqs = [core_seq(f"o{i}", [t], 4) for i, t in enumerate((7, 9))]
    with torch.no_grad():
        core.pending.extend(seqs)
        while core.batch or core.pending:
            core.step()
    assert [s.future.result(timeout=0)["output_ids"] for s in seqs] == [
        hf_greedy(model, [t], 4) for t in (7, 9)]


def test_the_engine_decodes_on_its_own_thread_count(model) -> None:
    """`threads` applies to the generation loop only (OpenMP's count is per thread): the
    caller's threads keep theirs."""
    before = torch.get_num_threads()
    core = EmbeddedCore(model, threads=1)
    core.start()
    try:
        assert core.call(torch.get_num_threads).result(timeout=30) == 1
        s = core_seq("t", PROMPTS[0], 4)
        core.submit(s)
        assert s.future.result(timeout=60)["output_ids"] == hf_greedy(model, PROMPTS[0], 4)
    finally:
        core.stop()
    assert torch.get_num_threads() == before


def test_a_decode_step_writes_the_kv_cache_in_place(model) -> None:
    """No per-step copy: the slabs keep their storage until a row joins, and when one leaves
    (the last rows move into its place)."""
    core = EmbeddedCore(model)
    with torch.no_grad():
        core.pending.extend([core_seq("a", PROMPTS[0], 20), core_seq("b", PROMPTS[1], 8)])
        core.step()
        ptrs, width = [layer.kbuf.data_ptr() for layer in core.cache.layers], core.width
        for _ in range(5):
            core.step()
        assert [layer.kbuf.data_ptr() for layer in core.cache.layers] == ptrs
        assert core.width == width + 5
        while len(core.batch) == 2:
            core.step()  # "b" leaves: "a" moves into its row, in the same storage
        assert core.pad.tolist() == [0] and not core.padded
        assert [layer.kbuf.data_ptr() for layer in core.cache.layers] == ptrs


def test_prefill_buckets_cut_where_the_padding_saved_pays_for_a_pass() -> None:
    assert prefill_buckets([7, 7, 7], 256) == [[0, 1, 2]]
    assert prefill_buckets([190, 10, 180, 10], 256) == [[1, 3], [2, 0]]
    assert prefill_buckets([190, 10, 180, 10], 10**6) == [[1, 3, 2, 0]]
    assert prefill_buckets([5, 3, 9], 0) == [[1], [0], [2]]
    assert prefill_buckets([], 256) == []


def test_prompts_sharing_a_prefix_run_it_once_and_keep_generates_outputs(model) -> None:
    """Prompts that open alike (an agent's system prompt, a group's repeated question): the
    shared part runs once and later prompts run after its cached keys and values, in passes
    whose rows differ in length; every output still equals `generate` of its prompt alone."""
    rng = random.Random(5)
    system = [rng.randrange(1, 512) for _ in range(60)]
    question = system + [rng.randrange(1, 512) for _ in range(40)]
    prompts = ([system + [rng.randrange(1, 512) for _ in range(n)] for n in (5, 30, 1, 12)]
               + [question, list(question), [*question, 7, 8, 9]])
    core = EmbeddedCore(copy.deepcopy(model), max_batch_size=8)
    assert core.prefixes is not None
    seqs = [core_seq(f"p{i}", p, 6) for i, p in enumerate(prompts)]
    with torch.no_grad():
        core.pending.append(seqs[0])  # nothing to share with yet
        core.step()
        core.pending.extend(seqs[1:])  # joins the running row
        while core.batch or core.pending:
            core.step()
    for s, p in zip(seqs, prompts, strict=True):
        assert s.future.result(timeout=0)["output_ids"] == hf_greedy(model, p, 6)
        assert max_diff(s.logprobs, full_logprobs(model, p, s.out)) < TOL
    info = core.prefixes.info()
    # the system prompt (60 tokens) from the second prompt on; the question (100) once it
    # repeats, its copy taking all but its last token (99)
    assert set(map(len, core.prefixes.shared_runs)) == {60, 99}
    assert info["hits"] == 6 and info["tokens_saved"] == 60 * 4 + 99 * 2
    assert info["tokens_computed"] == 99


def test_answers_go_out_after_the_step_and_before_the_abort_that_gave_them(model) -> None:
    """Requests finishing in one step are answered when it ends, not one by one inside it
    (each answer wakes the caller's loop, which takes the GIL from the step); an abort
    answers the requests it ended before its own call returns."""
    core = EmbeddedCore(copy.deepcopy(model), max_batch_size=4)
    seqs = [core_seq(f"s{i}", p, n) for i, (p, n) in
            enumerate(zip(mixed_prompts(3, 2, 20, seed=9), (2, 2, 4), strict=True))]
    stepping, seen = [False], []
    decode = core._decode

    def traced() -> None:
        stepping[0] = True
        try:
            decode()
        finally:
            stepping[0] = False

    core._decode = traced
    for s in seqs:
        s.future.add_done_callback(lambda f, rid=s.rid: seen.append((rid, stepping[0])))
    with torch.no_grad():
        core.pending.extend(seqs)
        while core.batch or core.pending:
            core.step()
    assert sorted(seen) == [("s0", False), ("s1", False), ("s2", False)]
    assert [s.future.result(timeout=0)["output_ids"] for s in seqs] == [
        hf_greedy(model, s.prompt, s.sampling.max_new_tokens) for s in seqs]

    order: list[str] = []
    long = [core_seq(f"l{i}", p, 500) for i, p in enumerate(mixed_prompts(2, 2, 20, seed=3))]
    for s in long:
        s.future.add_done_callback(lambda f, rid=s.rid: order.append(rid))
    core.start()
    try:
        for s in long:
            core.submit(s)
        while len(core.batch) < 2:
            time.sleep(0.01)
        aborted = core.call(lambda: core.abort(None, abort_all=True))
        aborted.add_done_callback(lambda f: order.append("abort call"))
        assert aborted.result(timeout=60) == 2
    finally:
        core.stop()
    assert order == ["l0", "l1", "abort call"] or order == ["l1", "l0", "abort call"]
    assert all(s.future.result(timeout=0)["meta_info"]["finish_reason"]["type"] == "abort"
               for s in long)


def test_a_weight_update_or_flush_drops_the_cached_prefixes(model, tmp_path) -> None:
    """Cached keys and values belong to the weights that computed them: after an update the
    same prompts give the new model's outputs."""
    rng = random.Random(6)
    system = [rng.randrange(1, 512) for _ in range(50)]
    prompts = [system + [rng.randrange(1, 512) for _ in range(n)] for n in (3, 9)]
    core = EmbeddedCore(copy.deepcopy(model))

    def generate_all(tag: str) -> list[list[int]]:
        seqs = [core_seq(f"{tag}{i}", p, 5) for i, p in enumerate(prompts)]
        with torch.no_grad():
            for s in seqs:  # one at a time: the second takes the first's prefix
                core.pending.append(s)
                while core.batch or core.pending:
                    core.step()
        return [s.future.result(timeout=0)["output_ids"] for s in seqs]

    assert generate_all("a") == [hf_greedy(model, p, 5) for p in prompts]
    assert len(core.prefixes.shared_runs) == 1 and len(core.prefixes.finished) == 2
    ref = perturbed(model)
    core.load_weights(checkpoint_tensors(ref, tmp_path / "new"), version=1)
    assert not (core.prefixes.shared_runs or core.prefixes.finished or core.prefixes.recent)
    hits = core.prefixes.hits
    # the same prompts again start cold, as in a fresh engine (a resumed run's): the first
    # runs whole, the second caches the 50 shared tokens anew (from the new weights)
    assert generate_all("b") == [hf_greedy(ref, p, 5) for p in prompts]
    assert sorted(map(len, core.prefixes.shared_runs)) == [50]
    assert core.prefixes.hits == hits + 1
    core.flush_cache()
    assert not (core.prefixes.shared_runs or core.prefixes.finished or core.prefixes.recent)


def test_a_turn_that_extends_a_finished_request_runs_only_its_new_tokens(model) -> None:
    """A ReAct turn's prompt is the last prompt, its output and the tool's answer: the finished
    request's keys and values are kept, and the next turn runs after them."""
    rng = random.Random(7)
    first = [rng.randrange(1, 512) for _ in range(40)]
    core = EmbeddedCore(copy.deepcopy(model))
    turns, prompt = [], first
    with torch.no_grad():
        for t in range(3):
            s = core_seq(f"t{t}", prompt, 6)
            core.pending.append(s)
            while core.batch or core.pending:
                core.step()
            out = s.future.result(timeout=0)["output_ids"]
            assert out == hf_greedy(model, prompt, 6)
            assert max_diff(s.logprobs, full_logprobs(model, prompt, out)) < TOL
            turns.append(len(prompt))
            prompt = [*prompt, *out, *[rng.randrange(1, 512) for _ in range(9)]]
    # turns 2 and 3 took their last turn's prompt and output but its last token
    info = core.prefixes.info()
    assert info["hits"] == 2 and info["tokens_saved"] == sum(n + 5 for n in turns[:2])
    assert info["finished"] == 3 and info["shared_runs"] == 0


def test_turns_after_different_cached_prefixes_share_one_prefill_pass(model) -> None:
    """Agents' next turns each extend their own finished request (prefixes of different
    lengths) and join with a prompt that has none: one prefill pass runs them all, each row as
    [padding, prefix, padding, suffix], and every output equals `generate` of its prompt."""
    rng = random.Random(8)
    firsts = [[rng.randrange(1, 512) for _ in range(n)] for n in (40, 57, 71)]
    core = EmbeddedCore(copy.deepcopy(model), max_batch_size=8)
    with torch.no_grad():
        seqs = [core_seq(f"a{i}", p, 6) for i, p in enumerate(firsts)]
        for s in seqs:  # one at a time: three finished entries, no shared opening
            core.pending.append(s)
            while core.batch or core.pending:
                core.step()
        prompts = [[*p, *s.future.result(timeout=0)["output_ids"],
                    *[rng.randrange(1, 512) for _ in range(k)]]
                   for p, s, k in zip(firsts, seqs, (9, 12, 7), strict=True)]
        prompts.append([rng.randrange(1, 512) for _ in range(10)])  # no cached prefix
        passes = []
        prefill_rows = core._prefill_rows
        core._prefill_rows = lambda *a: passes.append(a[2]) or prefill_rows(*a)
        seqs = [core_seq(f"b{i}", p, 6) for i, p in enumerate(prompts)]
        core.pending.extend(seqs)
        while core.batch or core.pending:
            core.step()
    # one pass; each prefix: a prompt and 5 of its 6 outputs
    assert len(passes) == 1 and sorted(passes[0]) == [0, 45, 62, 76]
    for s, p in zip(seqs, prompts, strict=True):
        assert s.future.result(timeout=0)["output_ids"] == hf_greedy(model, p, 6)
        assert max_diff(s.logprobs, full_logprobs(model, p, s.out)) < TOL
    info = core.prefixes.info()
    assert info["hits"] == 3 and info["tokens_saved"] == 45 + 62 + 76


def test_the_recent_prompts_share_openings_as_a_loop_over_them_would() -> None:
    """`PrefixCache.shared` (the longest opening a prompt shares with one of the last `recent`
    prompts, at most its length - 1) answers as comparing it with each of them would, as the
    window slides, the matrix grows for longer prompts, and clears."""
    from megatron_rl.engines.prefix_cache import PrefixCache

    def loop(window: list[list[int]], toks: list[int]) -> int:
        best = 0
        for other in window:
            n = min(len(toks), len(other))
            best = max(best, next((i for i in range(n) if toks[i] != other[i]), n))
        return min(best, len(toks) - 1)

    rng = random.Random(1)
    cache, window = PrefixCache(recent=5), []
    for i in range(1500):
        n = rng.choice([1, 2, 8, 40, 70, 200])  # past the matrix's first 64 columns too
        toks = [rng.randrange(3) for _ in range(n)]  # 3 ids: long shared runs
        assert cache.shared(toks) == loop(window, toks), (i, toks)
        window = [*window, toks][-5:]
        if rng.random() < 0.01:
            cache.clear()
            window = []
    assert len(cache.recent) == len(window) == 5


def test_the_prefix_cache_finds_the_longest_cached_prefix_as_a_scan_would() -> None:
    """The key trie answers `longest` as a scan over every entry would, through adds, key
    replacements, evictions (the trie drops the evicted keys' branches) and clears, with at
    most two nodes a key."""
    from megatron_rl.engines.prefix_cache import PrefixCache

    def kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:  # 8 bytes a token
        return [(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1))]

    def scan(cache: PrefixCache, toks: list[int]) -> tuple[int, ...]:
        keys = [*cache.shared_runs, *cache.finished]
        return max((k for k in keys if len(k) < len(toks) and tuple(toks[:len(k)]) == k),
                   key=len, default=())

    rng = random.Random(0)
    cache = PrefixCache(max_bytes=8 * 200)
    for i in range(2000):
        toks = [rng.randrange(3) for _ in range(rng.randint(1, 24))]  # 3 ids: many overlaps
        assert cache.longest(toks) == scan(cache, toks), (i, toks)
        if rng.random() < 0.5:
            cache.add(tuple(toks[:rng.randint(1, len(toks))]), kv(len(toks)),
                      finished=rng.random() < 0.5)
        if rng.random() < 0.005:
            cache.clear()
        assert trie_nodes(cache.keys) <= 2 * (len(cache.shared_runs) + len(cache.finished)) + 1
    assert cache.shared_runs or cache.finished
    for key in [*cache.shared_runs, *cache.finished]:  # every kept key is found
        assert cache.longest([*key, 9]) == key
    cache.clear()
    assert not cache.keys.root.edges and cache.longest([0, 1, 2]) == ()


def trie_nodes(trie) -> int:
    todo, n = [trie.root], 0
    while todo:
        node = todo.pop()
        n += 1
        todo += [child for _, child in node.edges.values()]
    return n


def test_agent_turns_share_one_trie_edge_for_their_common_opening() -> None:
    """The key index is a radix trie: turns that open alike share one edge for the opening
    (a node a token made ~10k nodes for 40 turns; freeing them held a weight commit ~1 ms)."""
    from megatron_rl.engines.prefix_cache import KeyTrie

    system = tuple(range(100, 300))  # 200 tokens every turn opens with
    trie = KeyTrie()
    turns = [system + tuple(range(1000 * i, 1000 * i + 50)) for i in range(1, 41)]
    for key in turns:
        trie.insert(key)
    assert trie_nodes(trie) == 1 + 1 + 40  # root, the opening, one leaf a turn
    assert trie.longest([*turns[7], 5]) == turns[7]
    assert trie.longest(list(turns[7])) == ()  # a key must leave a token to run
    assert trie.longest([*system, 1]) == ()
    trie.insert(system)  # a key ending where the edges part
    assert trie.longest([*system, 1]) == system
    for key in turns:
        trie.remove(key)
    assert trie_nodes(trie) == 2 and trie.longest([*turns[0], 5]) == system


def test_trie_keys_that_part_inside_long_edges_split_them_where_they_part() -> None:
    """Inserting walks an edge as slices, not token by token: keys that part from a long edge
    anywhere along it (or run its whole length) split it at exactly that token."""
    from megatron_rl.engines.prefix_cache import KeyTrie
    from megatron_rl.utils.tokens import shared_prefix_length

    rng = random.Random(0)
    for _ in range(3000):  # against the definition, on few symbols (long equal runs)
        label = tuple(rng.randint(0, 2) for _ in range(rng.randint(0, 40)))
        i = rng.randint(0, 5)
        key = tuple(rng.randint(0, 2) for _ in range(rng.randint(0, 45)))
        want = next((n for n, (a, b) in enumerate(zip(label, key[i:])) if a != b),
                    max(0, min(len(label), len(key) - i)))
        assert shared_prefix_length(label, key, i) == want
        assert shared_prefix_length(list(label), list(key), i) == want
        assert shared_prefix_length(list(label), key, i) == want  # a list against a tuple
    opening = tuple(range(3000))  # one 3,000-token edge, parted at several depths
    trie = KeyTrie()
    trie.insert(opening)
    parted = [(*opening[:n], -n) for n in (1, 2, 999, 1000, 2999)]
    for key in parted:
        trie.insert(key)
    for key in (opening, *parted):
        assert trie.longest([*key, 7]) == key
    assert trie.longest([*opening[:1000], -1000, 7]) == parted[3]
    assert trie.longest([*opening[:1500], 7]) == ()  # no key ends at 1,500
    assert trie_nodes(trie) == 1 + 5 + 5 + 1  # root, a node a parting depth, 5 leaves, the end


def test_the_prefix_cache_keeps_prefixes_shared_with_recent_prompts() -> None:
    from megatron_rl.engines.prefix_cache import PrefixCache

    def kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:  # 8 bytes a token
        return [(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1))]

    cache = PrefixCache(min_tokens=4, recent=2, max_bytes=8 * 30)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    assert cache.plan(a) == ((), ())  # nothing seen yet
    assert cache.plan([1, 2, 3, 4, 5, 9]) == ((), (1, 2, 3, 4, 5))
    assert cache.add((1, 2, 3, 4, 5), kv(5))
    # 7 shared with `a`: 2 more than the cached 5, fewer than min_tokens more
    assert cache.plan([1, 2, 3, 4, 5, 6, 7, 0]) == ((1, 2, 3, 4, 5), ())
    assert cache.plan(list(a)) == ((1, 2, 3, 4, 5), ())  # a left the 2 recent prompts
    long = list(range(100, 120))
    cache.plan(long)
    # the same prompt again: all but its last token, which must run for the next one's logits
    assert cache.plan([*long, 1]) == ((), tuple(long))
    assert cache.longest([1, 2, 3, 4, 5]) == ()  # the prompt is the prefix: nothing to run
    assert cache.add(tuple(long), kv(20)) and cache.bytes == 8 * 25
    # a finished request's tokens go first when the budget is short, then the oldest runs
    assert cache.add((7, 7, 7, 7), kv(4), finished=True)
    assert list(cache.finished) == [(7, 7, 7, 7)] and cache.bytes == 8 * 29
    assert cache.add((9, 9, 9, 9), kv(4))
    assert not cache.finished and cache.bytes == 8 * 29
    assert cache.add((8, 8, 8, 8), kv(4))
    assert list(cache.shared_runs) == [tuple(long), (9, 9, 9, 9), (8, 8, 8, 8)]
    assert cache.bytes == 8 * 28
    assert not cache.add((5,) * 31, kv(31))  # alone over the budget: not kept
    assert cache.get(tuple(long)) is cache.kv(tuple(long))
    assert cache.hits == 1 and cache.tokens_saved == 20
