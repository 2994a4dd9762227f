"""Oracle teacher trajectories over the embedded world: the real agent, real search and visit
tools, the known path; written as the RL loop's trajectory JSONL."""

from __future__ import annotations

import asyncio
import json

import pytest

from megatron_rl.agents.base import AgentConfig
from megatron_rl.agents.itersynth import IterSynthAgent
from megatron_rl.agents.react import ReActAgent
from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.data.world import build_world_index
from megatron_rl.engines.base import SamplingParams
from megatron_rl.env.search import LocalSearch
from megatron_rl.env.visit import LocalPages, Visit
from megatron_rl.records.trajectory import Trajectory
from megatron_rl.rewards.composite import build_judge
from megatron_rl.teacher import READ, OracleEngine, run_teacher, world_prompts


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    prompts, w = world_prompts(300, 0, 12)
    index = build_world_index(w, tmp_path_factory.mktemp("world"))
    return prompts, index


@pytest.mark.parametrize("cls", [ReActAgent, IterSynthAgent])
def test_oracle_trajectories_follow_the_path_through_the_real_tools(world, cls, tmp_path):
    prompts, index = world
    tok = tiny_qwen3_tokenizer()
    agent = cls(tok, [LocalSearch(index), Visit(LocalPages(index))],
                AgentConfig(max_turns=12, max_context_tokens=16384,
                            sampling=SamplingParams(temperature=0.0, max_new_tokens=512)))
    kind = "itersynth" if cls is IterSynthAgent else "react"
    out = tmp_path / "teacher.jsonl"
    counts = asyncio.run(run_teacher(prompts, agent, OracleEngine(tok, kind), oracle=True,
                                     judge=build_judge(None), out=out, progress=False))
    print(f"\n{kind}: {counts}")
    assert counts["written"] == len(prompts) == 12 and counts["correct"] == 12
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    trajs = [Trajectory.from_dict({k: v for k, v in r.items() if k != "step"}) for r in rows]
    for t, p in zip(trajs, prompts, strict=True):
        calls = [c for turn in t.turns for c in turn.tool_calls]
        if kind == "itersynth":
            # the Planner's step is a function of the notes it sees (what a policy can learn):
            # equal notes, equal step; it never repeats a call and visits only support pages
            # its notes hold
            notes = ["", *t.metadata["summaries"]]
            planner = [turn.text for turn in t.turns if turn.role == "planner"]
            step_of: dict[str, str] = {}
            assert all(step_of.setdefault(notes[k], text) == text
                       for k, text in enumerate(planner))
            keys = [(c.name, json.dumps(c.arguments, sort_keys=True)) for c in calls]
            assert len(set(keys)) == len(keys) and calls[0].name == "search"
            for k, c in enumerate(calls):
                if c.name == "visit":
                    assert c.arguments["url"] in notes[k]
                    assert c.arguments["url"] in p.metadata["support"]
                    assert f"{c.arguments['url']}{READ}" in notes[k + 1]  # marked read
            assert p.answer in notes[-1]
        else:
            # search the question, then visit + search per hop (the last hop: visit only)
            hops = len(p.metadata["support"])
            plan = ["search"] + ["visit", "search"] * (hops - 1) + ["visit"]
            assert [c.name for c in calls] == plan
            assert [c.arguments["url"] for c in calls if c.name == "visit"] == \
                p.metadata["support"]
        assert all(c.error is None and c.observation for c in calls)  # real, successful calls
        assert t.answer == p.answer and t.rewards["outcome"] == 1.0
        assert t.status == "ok" and t.sequences()  # trainable as it stands
        # bridge searches use the entity the visited page named: grounded after hop 1
        assert t.metadata["teacher"]["kind"] == "oracle"
        if kind == "itersynth":  # the Synthesizer's notes keep the bridge facts
            notes = " ".join(turn.text for turn in t.turns if turn.role == "synthesizer")
            assert all(f in notes for f in p.metadata["facts"]), (notes, p.metadata["facts"])
    assert counts["grounded"] >= 6  # the world's questions name their first entity
