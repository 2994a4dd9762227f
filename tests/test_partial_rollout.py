"""Partial rollout (Iris): a session cut at the step boundary resumes next step from its last
committed message in the rollout forest, under the new weights, and its trajectory splices the
two policy versions; the scheduler's state (cursor, requeued groups, forest) survives JSON."""

from __future__ import annotations

import asyncio
import json

import pytest

from megatron_rl.agents import IterSynthAgent, ReActAgent
from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.engines.base import SamplingParams
from megatron_rl.records.prompt import Prompt
from megatron_rl.rewards.composite import score_group
from megatron_rl.rewards.rule import RuleJudge
from megatron_rl.rollout.forest import RolloutForest
from megatron_rl.rollout.scheduler import RolloutScheduler, SchedulerConfig
from tests.fakes import DEMO_PAGES, DictSearch, DictVisit, ScriptedEngine, agent_config
from tests.fakes import tool_call_text as call

TOK = tiny_qwen3_tokenizer()
LONG_CALLS = 3  # tool calls the 'long' question makes before answering


def policy(context: str) -> str:
    """'long' questions search LONG_CALLS times, then answer; 'quick' ones answer at once.
    (IterSynth's Synthesizer adds a 'clue' to the notes after each search.)"""
    if "Synthesizer" in context:
        return "clue " * (context.count("clue") + 1)
    if ("quick" in context or context.count("<tool_response>") >= LONG_CALLS
            or context.count("clue") >= LONG_CALLS):
        return "<answer>Paris</answer>"
    return call("search", query="capital of France")


class GateEngine(ScriptedEngine):
    """At weight version 0 the 'long' session's third message never returns, and 'quick'
    answers only once that message has started: the step is cut with 'long' two messages in."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, policy)
        self.calls: dict[str, int] = {"long": 0, "quick": 0}
        self.gate: asyncio.Event | None = None

    async def generate(self, req):
        self.gate = self.gate or asyncio.Event()
        kind = "long" if "long" in self.tokenizer.decode(req.input_ids) else "quick"
        self.calls[kind] += 1
        if self.weight_version == 0 and kind == "long" and self.calls["long"] == 3:
            self.gate.set()
            await asyncio.sleep(3600)  # cancelled by the step cut
        if self.weight_version == 0 and kind == "quick":
            await self.gate.wait()
        return await super().generate(req)


def _scheduler(partial: bool, agent_cls=ReActAgent) -> RolloutScheduler:
    agent = agent_cls(TOK, [DictSearch(DEMO_PAGES), DictVisit(DEMO_PAGES)],
                      agent_config(max_turns=6, sampling=SamplingParams(max_new_tokens=64)))
    prompts = iter([Prompt("long 1", "Paris", "p0"), Prompt("quick 2", "Paris", "p1")])
    judge = RuleJudge()
    return RolloutScheduler(agent, GateEngine(TOK), prompts, lambda g: score_group(g, judge),
                            SchedulerConfig(samples_per_prompt=1, groups_per_step=1,
                                            oversample=2.0, dynamic_sampling=False,
                                            partial_rollout=partial))


async def _two_steps(sched: RolloutScheduler, between=None):
    first = await asyncio.wait_for(sched.collect(0), timeout=20)
    if between is not None:
        sched = between(sched)
    await sched.engine.update_weights_from_tensors([], weight_version=1)
    second = await asyncio.wait_for(sched.collect(1), timeout=20)
    return sched, first, second


def test_cut_session_resumes_from_its_committed_prefix_under_new_weights():
    sched, first, second = asyncio.run(_two_steps(_scheduler(partial=True)))
    assert [g[0].question for g in first.groups] == ["quick 2"]
    assert first.cancelled_prompts == 1
    (traj,) = second.groups[0]
    assert traj.question == "long 1" and traj.answer == "Paris"
    assert traj.rewards["outcome"] == 1.0
    # 2 messages at version 0 (committed), the lost third and the rest at version 1
    assert [t.weight_versions[0] for t in traj.turns] == [0, 0, 1, 1]
    assert sched.engine.calls["long"] == 5  # 4 turns + the one cut mid-generation
    assert second.metrics["rollout/resumed_samples"] == 1
    # the resumed context continues the committed one: still one training sequence
    (seq,) = traj.sequences()
    assert sum(seq.loss_mask) == sum(len(t.output_ids) for t in traj.turns)
    assert sorted(set(seq.weight_versions) - {-1}) == [0, 1]
    assert sched.forest.nodes == {}  # trained groups leave the forest


def test_without_partial_rollout_a_cut_session_starts_over():
    sched, _, second = asyncio.run(_two_steps(_scheduler(partial=False)))
    (traj,) = second.groups[0]
    assert [t.weight_versions[0] for t in traj.turns] == [1, 1, 1, 1]
    assert sched.engine.calls["long"] == 3 + 4
    assert second.metrics["rollout/resumed_samples"] == 0


def test_scheduler_state_survives_json_and_resumes_the_same_session():
    def reload(old: RolloutScheduler) -> RolloutScheduler:
        state = json.loads(json.dumps(old.state_dict()))
        assert state["started"] == 2 and len(state["requeued"]) == 1
        new = _scheduler(partial=True)
        new.engine = old.engine  # the engine outlives the trainer process
        new.load_state_dict(state)
        assert new.forest.versions(new.requeued[0].nodes[0]) == {0}
        return new

    sched, _, second = asyncio.run(_two_steps(_scheduler(partial=True), between=reload))
    (traj,) = second.groups[0]
    assert [t.weight_versions[0] for t in traj.turns] == [0, 0, 1, 1]
    assert sched.started == 2 and next(sched.prompts, None) is None


def test_itersynth_resumes_with_its_summary():
    _, _, second = asyncio.run(_two_steps(_scheduler(partial=True, agent_cls=IterSynthAgent)))
    (traj,) = second.groups[0]
    assert traj.answer == "Paris"
    versions = [t.weight_versions[0] for t in traj.turns]
    assert versions[:2] == [0, 0] and set(versions[2:]) == {1}
    # planner / synthesizer alternate across the splice
    assert traj.roles[:4] == ["planner", "synthesizer", "planner", "synthesizer"]


def test_forest_commit_copies_and_rebuilds():
    sched = _scheduler(partial=True)
    forest = RolloutForest()
    root = forest.root("p0")
    assert forest.resume(root) is None
    traj = asyncio.run(sched.agent.run("quick 2", "Paris", ScriptedEngine(TOK, policy),
                                       group_id="p0", uid="u"))
    node = forest.commit(root, traj, {"step": 1})
    traj.turns[0].output_ids.append(7)  # a later mutation does not reach the forest
    rebuilt, state = forest.resume(node)
    assert state == {"step": 1} and rebuilt.turns[0].output_ids[-1] != 7
    assert rebuilt.uid == "u" and rebuilt.answer == "Paris"
    with pytest.raises(ValueError, match="fewer than"):
        forest.commit(node, type(traj)("v", "p0", "q"), {})
    forest.release("p0")
    assert forest.nodes == {} and forest.roots == {}
