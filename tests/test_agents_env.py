"""A ReAct episode over the environment's real tools (local BM25 search + visit on the generated
world), driven by a scripted policy that reads its observations like a model would."""

from __future__ import annotations

import asyncio
import re

from megatron_rl.agents import IterSynthAgent, ReActAgent
from megatron_rl.data.world import BASE_URL, build_world_index, generate_world
from megatron_rl.engines.base import SamplingParams
from megatron_rl.env.search import LocalSearch
from megatron_rl.env.visit import ExtractiveSummarizer, LocalPages, Visit
from tests.fakes import ScriptedEngine, agent_config
from tests.fakes import tool_call_text as call
from tests.test_agents_react import TOK, assert_chained

URL = re.compile(re.escape(BASE_URL) + r"[^)\n]+")  # a link's target: a world URL holds spaces


def two_hop_policy(context: str) -> str:
    """search the question → visit the top hit → search its founder → visit → answer."""
    responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, re.S)
    question = re.search(r"Question: (.*?)(?:\n|<\|im_end\|>)|user\n(.*?)<\|im_end\|>", context)
    q = next(g for g in question.groups() if g)
    if len(responses) in (0, 2):
        if not responses:
            return call("search", query=q, top_k=3)
        founder = re.search(r"founded in \d+ by ([^.]+)\.", responses[1]).group(1)
        return call("search", query=founder, top_k=3)
    if len(responses) in (1, 3):
        return call("visit", url=URL.search(responses[-1]).group(0), goal="founder born")
    return "<answer>" + re.search(r"born in ([^.,]+)", responses[3]).group(1) + "</answer>"


def test_react_with_local_search_and_visit(tmp_path) -> None:
    world = generate_world(300, seed=3)
    index = build_world_index(world, tmp_path)
    q = next(q for q in world.questions(30, seed=1) if q.kind == "founder_birth_city")
    tools = [LocalSearch(index), Visit(LocalPages(index), ExtractiveSummarizer(max_chars=600))]
    engine = ScriptedEngine(TOK, two_hop_policy, weight_version=7)
    agent = ReActAgent(TOK, tools, agent_config(max_context_tokens=16_384,
                                                sampling=SamplingParams(max_new_tokens=512)))
    traj = asyncio.run(agent.run(q.question, q.answer, engine, group_id="g", uid="w"))
    assert traj.answer == q.answer and traj.labels == []
    visited = [c.arguments["url"] for t in traj.turns for c in t.tool_calls if c.name == "visit"]
    assert visited == list(q.support)
    assert_chained(traj, engine)
    # a visit of a page the corpus lacks is the environment's failure, shown to the model
    engine = ScriptedEngine(TOK, [call("visit", url=BASE_URL + "Nowhere"), "no notes",
                                  "<answer>x</answer>"])
    traj = asyncio.run(IterSynthAgent(TOK, tools, agent_config()).run(
        q.question, None, engine, group_id="g", uid="x"))
    assert traj.labels == ["visit_error"] and traj.roles == ["planner", "synthesizer", "planner"]
    assert "no page at" in traj.turns[0].tool_calls[0].observation
