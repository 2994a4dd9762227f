"""Rollout groups for a step: judged per group, zero-variance groups dropped and refilled,
sessions still running when the step is full cancelled and requeued for the next step."""

from __future__ import annotations

import asyncio
import collections
import re

from megatron_rl.agents import ReActAgent
from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.engines.base import GenerateResult, SamplingParams
from megatron_rl.records.prompt import Prompt, question_key
from megatron_rl.rewards.composite import score_group
from megatron_rl.rewards.rule import RuleJudge
from megatron_rl.rollout.scheduler import RolloutScheduler, SchedulerConfig
from megatron_rl.tasks.base import cycle
from tests.fakes import DEMO_PAGES, DictSearch, DictVisit, ScriptedEngine, agent_config

TOK = tiny_qwen3_tokenizer()


class Policy:
    """'mixed N' questions are answered right every other time they are asked (reward
    variance within the group), 'same N' ones always right (none)."""

    def __init__(self):
        self.asked: collections.Counter[str] = collections.Counter()
        self.all_right = False  # every question answered right (no group has variance)

    def __call__(self, context: str) -> str:
        question = re.search(r"(mixed|same|slow) \d+", context).group(0)
        self.asked[question] += 1
        right = self.all_right or question.startswith("same") or self.asked[question] % 2 == 1
        return "<answer>Paris</answer>" if right else "<answer>Lyon</answer>"


class SlowEngine(ScriptedEngine):
    async def generate(self, req):
        if "slow" in self.tokenizer.decode(req.input_ids):
            await asyncio.sleep(30)
        return await super().generate(req)


def _scheduler(questions, config, engine_cls=ScriptedEngine, repeat=False):
    agent = ReActAgent(TOK, [DictSearch(DEMO_PAGES), DictVisit(DEMO_PAGES)],
                       agent_config(sampling=SamplingParams(max_new_tokens=64)))
    prompts = cycle(questions, lambda q, uid: Prompt(q, "Paris", uid)) if repeat else \
        iter([Prompt(q, "Paris", f"p{i}") for i, q in enumerate(questions)])
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
    # the policy's own rate counts the dropped all-right groups: (8 + 4) / 16, not the kept 0.5
    assert out.metrics["rollout/sampled_outcome_mean"] == 0.75


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


class AbortableEngine(ScriptedEngine):
    """As a server does: a 'slow' request runs until aborted, then answers 'abort'. With
    `late`, a slow request reaches the engine only after its first abort (which finds nothing:
    the race of a request written just before the cut)."""

    def __init__(self, tokenizer, policy, late=False):
        super().__init__(tokenizer, policy)
        self.late, self.live, self.aborts, self.answered = late, {}, [], []
        self.aborted_once: asyncio.Event | None = None

    def _aborted_once(self) -> asyncio.Event:
        self.aborted_once = self.aborted_once or asyncio.Event()
        return self.aborted_once

    async def generate(self, req):
        if "slow" not in self.tokenizer.decode(req.input_ids):
            return await super().generate(req)
        if self.late:
            await self._aborted_once().wait()
        ended = self.live[req.rid] = asyncio.Event()
        await ended.wait()
        del self.live[req.rid]
        self.answered.append(req.rid)
        return GenerateResult(rid=req.rid, output_ids=[], output_logprobs=[],
                              finish_reason="abort", weight_versions=[])

    async def abort(self, rid):
        self.aborts.append(rid)
        if rid in self.live:
            self.live[rid].set()
        self._aborted_once().set()


def _cut_step(late: bool):
    sched = _scheduler(["mixed 1", "slow 2"],
                       SchedulerConfig(samples_per_prompt=2, groups_per_step=1, oversample=2.0,
                                       partial_rollout=True),
                       lambda tok, policy: AbortableEngine(tok, policy, late=late))
    out = asyncio.run(asyncio.wait_for(sched.collect(step=0), timeout=10))
    return sched.engine, out


def test_the_cut_aborts_its_requests_and_waits_for_their_answers():
    engine, out = _cut_step(late=False)
    assert [g[0].question for g in out.groups] == ["mixed 1"] and out.cancelled_prompts == 1
    # both samples of 'slow 2' were decoding: aborted once each, answered (not dropped)
    assert sorted(engine.aborts) == sorted(engine.answered) == ["p1/s0/0/0", "p1/s0/1/0"]
    assert engine.live == {}  # nothing of the step is left on the engine


def test_a_request_that_lands_after_its_abort_is_aborted_again():
    engine, out = _cut_step(late=True)
    assert out.cancelled_prompts == 1
    assert sorted(engine.answered) == ["p1/s0/0/0", "p1/s0/1/0"] and engine.live == {}
    assert sorted(engine.aborts) == ["p1/s0/0/0"] * 2 + ["p1/s0/1/0"] * 2


def test_a_request_its_engine_does_not_end_on_abort_is_dropped():
    """An engine whose abort is a no-op (NoServerControl): the cut cancels the call."""
    sched = _scheduler(["mixed 1", "slow 2"],
                       SchedulerConfig(samples_per_prompt=1, groups_per_step=1, oversample=2.0),
                       SlowEngine)
    out = asyncio.run(asyncio.wait_for(sched.collect(step=0), timeout=10))
    assert out.cancelled_prompts == 1


def test_dropped_groups_can_stay_for_some_roles():
    """`dropped_group_roles`: the groups dynamic sampling drops still come back (after the kept
    ones, at most `groups_per_step`), marked with the roles whose turns train in them."""
    sched = _scheduler(["same 1", "mixed 2", "same 3", "mixed 4", "mixed 5"],
                       SchedulerConfig(samples_per_prompt=4, groups_per_step=2,
                                       dynamic_sampling=True,
                                       dropped_group_roles=("synthesizer",)))
    out = asyncio.run(sched.collect(step=0))
    assert sorted(g[0].question for g in out.groups) == ["mixed 2", "mixed 4"]
    assert sorted(g[0].question for g in out.role_groups) == ["same 1", "same 3"]
    assert all(t.metadata["trained_roles"] == ["synthesizer"] for g in out.role_groups for t in g)
    assert all("trained_roles" not in t.metadata for g in out.groups for t in g)
    assert len(out.trajectories) == 16 and out.metrics["rollout/role_groups"] == 2
    assert out.dropped_groups == 2  # still counted as dropped: they refilled


SETTLING = ["same 1", "mixed 2", "same 3", "mixed 4"]


def _asked_over_steps(skip: float, steps: int = 12):
    config = SchedulerConfig(samples_per_prompt=4, groups_per_step=2, dynamic_sampling=True,
                             skip_settled=skip)
    sched = _scheduler(SETTLING, config, repeat=True)
    outs = [asyncio.run(sched.collect(step=s)) for s in range(steps)]
    return sched, outs


def test_settled_prompts_are_skipped_when_they_come_round_again():
    """`skip_settled` (GRESO): a prompt whose last group was dropped is mostly passed over
    next time, so the step stops paying for groups it would drop and refill."""
    plain, plain_outs = _asked_over_steps(skip=0.0)
    sched, outs = _asked_over_steps(skip=0.9)
    # the 'same' questions, by their key (their uids differ per epoch: q0.e3)
    assert plain.settled == sched.settled == {"q0", "q2"}
    plain_dropped = sum(o.dropped_groups for o in plain_outs)
    dropped = sum(o.dropped_groups for o in outs)
    skipped = sum(o.metrics["rollout/skipped_prompts"] for o in outs)
    assert plain_dropped == 24 and sum(o.skipped_prompts for o in plain_outs) == 0
    # step 0 meets both 'same' questions unsettled; later draws skip ~90 % of them
    assert 2 <= dropped <= 8 and skipped == sched.started - 2 * 12 - dropped
    same = sum(n for q, n in sched.engine.policy.asked.items() if q.startswith("same"))
    assert same == 4 * dropped < plain.engine.policy.asked["same 1"]
    # every step still has its groups, all of them with variance
    assert all(len(o.groups) == 2 for o in outs)
    assert all(g[0].question.startswith("mixed") for o in outs for g in o.groups)


def test_a_group_with_variance_unsettles_its_prompt():
    config = SchedulerConfig(samples_per_prompt=4, groups_per_step=2, dynamic_sampling=True,
                             max_refills=0, skip_settled=0.5)
    sched = _scheduler(["mixed 1", "mixed 2"], config, repeat=True)
    sched.engine.policy.all_right = True
    asyncio.run(sched.collect(step=0))
    assert sched.settled == {"q0", "q1"}
    sched.engine.policy.all_right = False
    for step in range(1, 8):
        asyncio.run(sched.collect(step=step))
    assert sched.settled == set()


def test_a_resumed_scheduler_skips_the_same_prompts():
    sched, _ = _asked_over_steps(skip=0.5, steps=4)
    state = sched.state_dict()
    assert state["settled"] == ["q0", "q2"]
    fresh = _scheduler(SETTLING, sched.cfg, repeat=True)
    fresh.load_state_dict(state)
    assert fresh.settled == sched.settled
    ahead = [asyncio.run(s.collect(step=4 + i)) for s in (sched, fresh) for i in range(4)]
    launched = [[g[0].question for g in o.groups + o.role_groups] for o in ahead]
    assert launched[:4] == launched[4:]
    skips = [o.skipped_prompts for o in ahead]
    assert skips[:4] == skips[4:] and sum(skips[:4]) > 0


def test_a_question_keeps_its_key_across_epochs():
    assert [question_key(u) for u in ("q3.e1", "train:0.e12", "my.eval:3", "q3")] == \
        ["q3", "train:0", "my.eval:3", "q3"]
