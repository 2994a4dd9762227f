"""Agents against a real engine: the embedded server over HTTP with a tiny random Qwen3-MoE.

A random policy writes no tool calls, so the episodes here are either purely sampled (length
cuts and continuations, random stops) or mixed: a scripted turn makes the tool call, then the
real model continues from a context that holds the observation. Either way the engine is fed
exactly the stored contexts and the trained tokens carry the engine's own log-probs.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import pytest

from megatron_rl.agents import AgentConfig, IterSynthAgent, ReActAgent
from megatron_rl.agents.itersynth import SYNTHESIZER_PROMPT
from megatron_rl.engines.base import GenerateRequest, GenerateResult, SamplingParams
from megatron_rl.engines.embedded import EmbeddedServer
from megatron_rl.engines.http_client import HttpEngine
from megatron_rl.records.trajectory import LABELS, Trajectory
from tests.fakes import DEMO_PAGES, PARIS, DictSearch, DictVisit, ScriptedEngine, agent_config
from tests.fakes import tool_call_text as call
from tests.test_agents_react import QUESTION, TOK, assert_chained
from tests.test_engine_embedded import tiny_model

TOOLS = [DictSearch(DEMO_PAGES), DictVisit(DEMO_PAGES)]


@pytest.fixture(scope="module")
def server():
    with EmbeddedServer(tiny_model(), TOK, model_path="tiny-moe").start() as s:
        yield s


class Routed:
    """Scripted turns where `scripted(request)` says so (and the rest of a cut scripted reply),
    the real engine for the others; records
    every request (the RolloutEngine protocol's generate is all an agent uses)."""

    def __init__(self, real: HttpEngine, script: list[str],
                 scripted: Callable[[GenerateRequest], bool]):
        self.real, self.script = real, ScriptedEngine(TOK, script, weight_version=0)
        self.scripted = scripted
        self.requests: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        use_script = self.script.mid_reply or self.scripted(req)
        self.requests.append(req)
        return await (self.script if use_script else self.real).generate(req)


# ~1 in 5 sampled tokens ends a message, so random messages finish (not only get cut)
STOPS = list(range(100, 200))


def config(seed: int = 0, stops: list[int] | None = None, **kw: Any) -> AgentConfig:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed,
                              stop_token_ids=stops or [])
    return agent_config(max_context_tokens=2048, max_continuations=3, max_turns=4,
                        sampling=sampling, **kw)


def check_real_turns(traj: Trajectory) -> None:
    assert set(traj.labels) <= set(LABELS)
    real = [t for t in traj.turns if any(lp != 0.0 for lp in t.output_logprobs)]
    assert real, "no turn came from the model"
    for t in real:
        assert 0 < len(t.output_ids) <= 12 and t.finish_reason in ("stop", "length")
        assert all(math.isfinite(lp) and lp < 0 for lp in t.output_logprobs)
        assert t.weight_versions == [0] * len(t.output_ids)
        assert t.text == TOK.decode(t.output_ids)


async def react_episodes(url: str, n: int) -> list[tuple[Trajectory, Routed]]:
    async with HttpEngine(url) as real:
        runs = []
        for i in range(n):  # episode i scripts its first turn when i is odd
            engine = Routed(real, [call("visit", url=PARIS)],
                            lambda req, i=i: i % 2 == 1 and req.rid.endswith("/0"))
            agent = ReActAgent(TOK, TOOLS, config(seed=i, stops=STOPS if i % 2 else None))
            runs.append((agent.run(QUESTION, "Paris", engine, group_id="g", uid=f"e{i}"), engine))
        trajs = await asyncio.gather(*(r for r, _ in runs))
        return list(zip(trajs, [e for _, e in runs]))


def test_react_episodes_over_http_chain_token_exactly(server) -> None:
    for i, (traj, engine) in enumerate(asyncio.run(react_episodes(server.url, 4))):
        assert_chained(traj, engine, versions=frozenset({0}))
        check_real_turns(traj)
        assert traj.roles == ["agent"] * len(traj.turns)
        if i % 2:  # the scripted visit ran and the model went on after its observation
            k = next(k for k, t in enumerate(traj.turns) if t.tool_calls)
            assert traj.turns[k].tool_calls[0].observation.startswith("Paris\n")
            assert len(traj.turns) > k + 1 and TOK.decode(traj.turns[k + 1].context_ids).endswith(
                "</tool_response><|im_end|>\n<|im_start|>assistant\n")
        # at most max_continuations resumes of one message, then `response_too_long`
        runs = "".join("L" if t.finish_reason == "length" else "." for t in traj.turns)
        assert "LLLLL" not in runs
        if "LLLL" in runs:
            assert "response_too_long" in traj.labels


def test_itersynth_episode_with_a_real_synthesizer(server) -> None:
    async def go() -> tuple[Trajectory, Routed]:
        async with HttpEngine(server.url) as real:
            # the Planner is scripted (two searches, then an answer); the model writes notes
            engine = Routed(real, [call("search", query="capital"), call("visit", url=PARIS),
                                   "<answer>Paris</answer>"],
                            lambda req: SYNTHESIZER_PROMPT not in TOK.decode(req.input_ids))
            agent = IterSynthAgent(TOK, TOOLS, config(stops=STOPS, degenerate_check=None))
            return await agent.run(QUESTION, "Paris", engine, group_id="g", uid="s"), engine

    traj, engine = asyncio.run(go())
    print("\n" + "\n".join(f"[{i}] {t.role:<11} {t.finish_reason:<6} {t.text!r}"
                           for i, t in enumerate(traj.turns)))
    assert [r.input_ids for r in engine.requests] == [t.context_ids for t in traj.turns]
    check_real_turns(traj)
    roles = traj.roles
    assert roles[0] == "planner" and "synthesizer" in roles
    # sequences: one per fresh prompt; a cut synthesizer output continues inside its own
    fresh = sum(1 for a, b in zip([None, *traj.turns], traj.turns)
                if a is None or b.context_ids != a.context_ids + a.output_ids)
    assert len(traj.sequences()) == fresh
    assert traj.answer == "Paris" and traj.status in ("ok", "tool_parse_error")
    assert roles.count("planner") >= 3 and len(traj.metadata["summaries"]) == 2
