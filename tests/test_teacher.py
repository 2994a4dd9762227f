"""Oracle teacher trajectories over the embedded world: the real agent, real search and visit
tools, the known path; written as the RL loop's trajectory JSONL."""

from __future__ import annotations

import asyncio
import json

import pytest

from megatron_rl.agents.base import AgentConfig
from megatron_rl.agents.formats import chat_family
from megatron_rl.agents.itersynth import IterSynthAgent
from megatron_rl.agents.react import ReActAgent
from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.data.world import build_world_index
from megatron_rl.engines.base import SamplingParams
from megatron_rl.env.search import LocalSearch
from megatron_rl.env.visit import LocalPages, Visit
from megatron_rl.records.trajectory import Trajectory
from megatron_rl.rewards.composite import build_judge
from megatron_rl.teacher import (
    READ,
    OracleEngine,
    OraclePath,
    oracle_notes,
    oracle_plan_step,
    run_teacher,
    world_prompts,
)


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
    engine = OracleEngine(tok, kind, visits="every-page")  # when-needed: the test below
    counts = asyncio.run(run_teacher(prompts, agent, engine, oracle=True,
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
                    assert f"({c.arguments['url']}){READ}" in notes[k + 1]  # marked read
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


def test_the_oracle_visits_only_when_the_results_did_not_state_the_fact(world, tmp_path):
    """The default oracle (`visits="when-needed"`) searches the next entity straight from a
    fact the results stated, and notes each fact as a sentence of what a tool returned; it
    takes fewer calls than visiting every support page, never more, and is as correct."""
    prompts, index = world
    tok = tiny_qwen3_tokenizer()
    runs = {}
    for visits in ("when-needed", "every-page"):
        agent = IterSynthAgent(tok, [LocalSearch(index, top_k=1), Visit(LocalPages(index))],
                               AgentConfig(max_turns=12, max_context_tokens=16384,
                                           sampling=SamplingParams(
                                   temperature=0.0, max_new_tokens=512)))
        out = tmp_path / f"{visits}.jsonl"
        counts = asyncio.run(run_teacher(prompts, agent, OracleEngine(tok, "itersynth", visits),
                                         oracle=True, judge=build_judge(None), out=out,
                                         progress=False))
        assert counts["correct"] == len(prompts), (visits, counts)
        runs[visits] = [Trajectory.from_dict({k: v for k, v in json.loads(x).items()
                                              if k != "step"})
                        for x in out.read_text().splitlines()]
    calls = {v: [[c for t in traj.turns for c in t.tool_calls] for traj in trajs]
             for v, trajs in runs.items()}
    assert all(len(a) <= len(b) for a, b in zip(calls["when-needed"], calls["every-page"],
                                                 strict=True))
    assert sum(map(len, calls["when-needed"])) < sum(map(len, calls["every-page"]))
    for traj, cs in zip(runs["when-needed"], calls["when-needed"], strict=True):
        assert all(len(c.observation or "") and c.arguments.get("top_k", 1) == 1 for c in cs)
        seen = " ".join(" ".join((c.observation or "").split()) for c in cs)
        for notes in traj.metadata["summaries"]:
            for line in notes.splitlines():
                if not line.startswith("- ["):  # a fact: a sentence a tool returned
                    assert line[2:] in seen.replace("[", "").replace("]", ""), line
        notes = ["", *traj.metadata["summaries"]]
        for k, c in enumerate(cs):
            if c.name == "visit":  # a page the notes listed as the results did
                assert f"]({c.arguments['url']})" in notes[k]
        assert "](" not in notes[-1]  # once the facts are in, the page lines have gone


def test_a_fact_the_results_did_not_state_is_read_from_its_page():
    """When-needed visits, step by step: the results lack the founder, so the notes list the
    page as the results did and the Planner visits it; the page states the fact, the notes keep
    that sentence (the one linking the hop's subject to the bridge) and drop the page line, and
    the Planner searches the bridge."""
    url = "https://w.test/Orvo_Labs"
    path = OraclePath([url, "https://w.test/Kel_Ranu"], ["Kel Ranu"], "Zen City",
                      start="Orvo Labs")
    family = chat_family("qwen3")
    q = "Which city is the birthplace of the founder of Orvo Labs?"
    results = ("[1] search {\"query\": \"Orvo Labs\"}\n<tool_response>\nA search for 'Orvo Labs' "
               f"found 1 results:\n1. [Orvo Labs]({url})\n   Orvo Labs is a chemicals company."
               "\n</tool_response>")
    notes = oracle_notes("", results, path)
    assert notes == f"- [Orvo Labs]({url})"
    assert '"visit"' in oracle_plan_step(q, notes, path, family) and url in \
        oracle_plan_step(q, notes, path, family)
    page = (f"[1] visit {{\"url\": \"{url}\"}}\n<tool_response>\nKel Ranu is a chemist. "
            "Orvo Labs was founded by Kel Ranu.\n</tool_response>")
    notes = oracle_notes(notes, page, path)
    assert notes == "- Orvo Labs was founded by Kel Ranu."
    step = oracle_plan_step(q, notes, path, family)
    assert '"search"' in step and '"Kel Ranu"' in step
    # visiting every page instead: the line stays, marked read
    every = oracle_notes(f"- [Orvo Labs]({url})", page, path, "every-page")
    assert every.splitlines()[0] == f"- [Orvo Labs]({url}){READ}"
