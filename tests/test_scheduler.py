"""Rollout groups for a step: judged per group, zero-variance groups dropped and refilled,
sessions still running when the step is full cancelled and requeued for the next step."""

from __future__ import annotations

import asyncio
import collections
import re

from megatron_rl.agents import ReActAgent
from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.engines.base import SamplingParams
from megatron_rl.records.prompt import Prompt
from megatron_rl.rewards.composite import score_group
from megatron_rl.rewards.rule import RuleJudge
from megatron_rl.rollout.scheduler import RolloutScheduler, SchedulerConfig
from tests.fakes import DEMO_PAGES, DictSearch, DictVisit, ScriptedEngine, agent_config

TOK = tiny_qwen3_tokenizer()


class Policy:
    """'mixed N' questions are answered right every other time they are asked (reward
    variance within the group), 'same N' ones always right (none)."""

    def __init__(self):
        self.asked: collections.Counter[str] = collections.Counter()

    def __call__(self, context: str) -> str:
        question = re.search(r"(mixed|same|slow) \d+", context).group(0)
        self.asked[question] += 1
        right = question.startswith("same") or self.asked[question] % 2 == 1
        return "<answer>Paris</answer>" if right else "<answer>Lyon</answer>"


class SlowEngine(ScriptedEngine):
    async def generate(self, req):
        if "slow" in self.tokenizer.decode(req.input_ids):
            await asyncio.sleep(30)
        return await super().generate(req)


def _scheduler(questions, config, engine_cls=ScriptedEngine):
    agent = ReActAgent(TOK, [DictSearch(DEMO_PAGES), DictVisit(DEMO_PAGES)],
                       agent_config(sampling=SamplingParams(max_new_tokens=64)))
    prompts = iter([Prompt(q, "Paris", f"p{i}") for i, q in enumerate(questions)])
    judge = RuleJudge()
    return RolloutScheduler(agent, engine_cls(TOK, Policy()), prompts,
                            lambda group: score_group(group, judge), config)


def test_zero_variance_groups_are_dropped_and_refilled():
    sched = _scheduler(["same 1", "mixed 2", "same 3", "mixed 4", "mixed 5"],
                       SchedulerConfig(samples_per_prompt=4, groups_per_step=2,
                                       dynamic_sampling=True))
    out = asyncio.run(sched.collect(step=0))
    # same 1 (dropped) → refill same 3 (dropped) → refill mixed 4; kept: mixed 2, mixed 4
    assert len(out.groups) == 2 and out.dropped_groups == 2
    for group in out.groups:
        assert len({t.group_id for t in group}) == 1 and len(group) == 4
        assert sorted(t.rewards["outcome"] for t in group) == [0.0, 0.0, 1.0, 1.0]
    assert sorted(g[0].question for g in out.groups) == ["mixed 2", "mixed 4"]
    assert out.metrics["rollout/groups"] == 2


def test_running_sessions_are_cancelled_and_requeued():
    sched = _scheduler(["mixed 1", "slow 2", "mixed 3", "mixed 4"],
                       SchedulerConfig(samples_per_prompt=2, groups_per_step=1, oversample=2.0),
                       SlowEngine)

    async def two_steps():
        first = await asyncio.wait_for(sched.collect(step=0), timeout=10)
        requeued = [g.prompt.question for g in sched.requeued]
        return first, requeued

    first, requeued = asyncio.run(two_steps())
    assert len(first.groups) == 1 and first.groups[0][0].question == "mixed 1"
    assert first.cancelled_prompts == 1 and requeued == ["slow 2"]
    assert sched._next_group().prompt.question == "slow 2"  # first in line next step
