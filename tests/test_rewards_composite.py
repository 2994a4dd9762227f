"""Composite reward assembly (score_group, turn rewards, build_judge) and the abnormal-trajectory
taxonomy metrics on a constructed batch, with hand-computed numbers."""

from __future__ import annotations

import asyncio

import pytest

from megatron_rl.records.trajectory import ToolCall, Trajectory, Turn
from megatron_rl.rewards.base import JUDGE_ERROR, Verdict
from megatron_rl.rewards.composite import (
    RewardWeights,
    build_judge,
    score_group,
    turn_rewards,
)
from megatron_rl.rewards.genrm import GenRMJudge
from megatron_rl.rewards.rubric import RubricScorer
from megatron_rl.rewards.rule import RuleJudge
from megatron_rl.rewards.taxonomy import taxonomy_metrics
from megatron_rl.utils.chat_client import ClientConfig
from megatron_rl.utils.metrics import MetricsLogger
from tests.test_rewards_fakes import FakeJudgeServer, rubric_reply


def _turn(role: str = "agent", text: str = "", finish: str = "stop",
          calls: list[ToolCall] | None = None, rewards: dict[str, float] | None = None) -> Turn:
    return Turn(role, [1], [2, 3], [-0.1, -0.2], [0, 0], tool_calls=calls or [],
                finish_reason=finish, text=text, rewards=rewards or {})


def _traj(uid: str, text: str, finish: str = "stop", **kw) -> Trajectory:
    return Trajectory(uid, "g", f"{uid}: who wrote the first program?", reference="Ada Lovelace",
                      turns=[_turn(text=text, finish=finish)], **kw)


class CountingJudge:
    def __init__(self, inner: RuleJudge):
        self.inner = inner
        self.seen: list[str | None] = []

    async def judge(self, question: str, answer: str | None, reference: str) -> Verdict:
        self.seen.append(answer)
        return await self.inner.judge(question, answer, reference)


class BrokenJudge:
    async def judge(self, question: str, answer: str | None, reference: str) -> Verdict:
        raise RuntimeError("bug in a custom judge")


def test_score_group_outcomes_truncation_and_judge_failures() -> None:
    group = [
        _traj("ok", "<answer>Ada Lovelace</answer>"),
        _traj("partial", "<answer>Lovelace</answer>"),           # F1: P=1, R=1/2
        _traj("truncated", "<answer>Ada Lovelace</answer> and", finish="length"),
        _traj("overlong", "<answer>Ada Lovelace</answer>", labels=["overlong"]),
        _traj("no_answer", "I searched but found nothing"),
        _traj("recorded", "whatever", answer="  Ada Lovelace "),  # the agent's answer wins
    ]
    judge = CountingJudge(RuleJudge("f1"))
    verdicts = asyncio.run(score_group(group, judge))
    outcome = {t.uid: t.rewards["outcome"] for t in group}
    assert outcome == pytest.approx({"ok": 1.0, "partial": 2 / 3, "truncated": 0.0,
                                     "overlong": 0.0, "no_answer": 0.0, "recorded": 1.0})
    assert judge.seen == ["Ada Lovelace", "Lovelace", None, "Ada Lovelace"]  # no call when cut
    assert [v.detail for v in verdicts[2:5]] == ["truncated", "truncated", "no answer"]
    assert group[1].metadata["judge"] == {"correct": False, "detail": "em=0 f1=0.667"}
    assert all(t.labels == [] for t in group if t.uid != "overlong")


def test_a_failing_judge_labels_instead_of_scoring_zero() -> None:
    t = _traj("x", "<answer>Ada</answer>", rewards={"outcome": 1.0})  # stale from a rescore
    (verdict,) = asyncio.run(score_group([t], BrokenJudge()))
    assert verdict.error == JUDGE_ERROR and verdict.detail == "judge raised RuntimeError"
    assert t.labels == [JUDGE_ERROR] and "outcome" not in t.rewards and t.env_failure
    assert turn_rewards(t) is None
    with pytest.raises(ValueError, match="no reference answer for trajectories nr"):
        asyncio.run(score_group([Trajectory("nr", "g", "q")], RuleJudge()))


def test_score_group_runs_concurrently() -> None:
    """Every trajectory's judge call is in flight at once (counted, not timed: a loaded
    machine made a wall-clock bound flaky)."""
    class SlowJudge:
        running = most = 0

        async def judge(self, question: str, answer: str | None, reference: str) -> Verdict:
            SlowJudge.running += 1
            SlowJudge.most = max(SlowJudge.most, SlowJudge.running)
            await asyncio.sleep(0.05)
            SlowJudge.running -= 1
            return Verdict(1.0, True)

    group = [_traj(f"t{i}", "<answer>a</answer>") for i in range(16)]
    asyncio.run(score_group(group, SlowJudge()))
    assert SlowJudge.most == 16
    assert all(t.rewards["outcome"] == 1.0 for t in group)


def test_group_with_genrm_and_rubric_over_http() -> None:
    planner = _turn("planner", "t1 <answer>Ada Lovelace</answer>")
    good = Trajectory("g1", "g", "q1: who?", reference="Ada Lovelace", turns=[planner])
    flaky = Trajectory("g2", "g", "q2: who?", reference="Ada Lovelace",
                       turns=[_turn("planner", "t2 <answer>Babbage</answer>")])
    script = {"q1": ["VERDICT: correct"], "q2": [("status", 503)],
              "t1": [rubric_reply(query_quality="N/A", non_redundancy="N/A", answer_timing=5,
                                  answer_grounding=4, tool_call_form="N/A")]}

    async def scenario() -> None:
        async with FakeJudgeServer(script) as verdicts, \
                FakeJudgeServer(script, key_pattern=r"\b(t\d+)\b") as grades:
            judge = GenRMJudge(ClientConfig(verdicts.url, max_retries=1, backoff_s=0.01))
            rubric = RubricScorer(ClientConfig(grades.url, max_retries=0))
            await score_group([good, flaky], judge, rubric)
            await judge.close()
            await rubric.close()

    asyncio.run(scenario())
    assert good.rewards == {"outcome": 1.0} and good.labels == []
    assert planner.rewards["rubric"] == pytest.approx((0.2 * 1 + 0.2 * 0.75) / 0.4)
    assert flaky.labels == [JUDGE_ERROR] and "outcome" not in flaky.rewards
    # the rubric judge has no script for t2: its default reply is not a rubric -> that turn
    # is N/A and counted (the trajectory's label comes from its outcome judge)
    assert flaky.turns[0].labels == [] and flaky.metadata["rubric_failed_turns"] == 1
    assert turn_rewards(good, RewardWeights(outcome=1.0, rubric=0.5)) == [1.0 + 0.5 * 0.875]


def test_build_judge() -> None:
    assert isinstance(build_judge(), RuleJudge) and build_judge().metric == "em"
    assert build_judge({"kind": "rule", "metric": "f1"}).metric == "f1"  # type: ignore[attr-defined]
    judge = build_judge({"kind": "genrm", "base_url": "http://127.0.0.1:9/v1", "model": "m",
                         "max_concurrency": 4})
    assert isinstance(judge, GenRMJudge) and judge.client.config.max_concurrency == 4
    with pytest.raises(ValueError, match=r"judge \(genrm\): unknown key\(s\) url"):
        build_judge({"kind": "genrm", "url": "http://x/v1"})
    with pytest.raises(ValueError, match="kind='reward_model'"):
        build_judge({"kind": "reward_model"})


# -- taxonomy ---------------------------------------------------------------------------------

def taxonomy_batch() -> list[Trajectory]:
    ok_search = ToolCall("search", {"query": "x"})
    a = Trajectory("a", "g", "q", reference="r", rewards={"outcome": 1.0}, turns=[
        _turn("planner", calls=[ok_search], rewards={"rubric": 0.5}),
        _turn("synthesizer", rewards={"rubric": 0.75}),
        _turn("planner", rewards={"rubric": 1.0})])
    b = Trajectory("b", "g", "q", reference="r", rewards={"outcome": 0.0}, turns=[
        _turn(calls=[ToolCall("search", {}, error="search_error"), ToolCall("visit", {})]),
        _turn(calls=[ToolCall("visit", {}, error="visit_error")])])
    b.add_label("search_error")
    b.add_label("visit_error")
    c = Trajectory("c", "g", "q", reference="r", turns=[_turn()], labels=["judge_error"])
    d = Trajectory("d", "g", "q", reference="r", rewards={"outcome": 0.0}, turns=[
        _turn(calls=[ToolCall("sea rch!", {}, error="tool_parse_error")]), _turn(), _turn()],
        labels=["tool_parse_error", "max_turns"])
    e = Trajectory("e", "g", "q", reference="r", rewards={"outcome": 0.0},
                   turns=[_turn(finish="length")], labels=["overlong"])
    return [a, b, c, d, e]


def test_taxonomy_metrics_on_a_constructed_batch(tmp_path) -> None:
    m = taxonomy_metrics(taxonomy_batch(), weights=RewardWeights(outcome=1.0, rubric=0.5))
    expected = {
        "rollout/trajectories": 5.0,
        "abnormal/search_error_rate": 0.2, "abnormal/visit_error_rate": 0.2,
        "abnormal/summarizer_error_rate": 0.0, "abnormal/judge_error_rate": 0.2,
        "abnormal/overlong_rate": 0.2, "abnormal/degenerate_rate": 0.0,
        "abnormal/tool_parse_error_rate": 0.2, "abnormal/max_turns_rate": 0.2,
        "abnormal/excess_tool_calls_rate": 0.0, "abnormal/response_too_long_rate": 0.0,
        "abnormal/repeated_state_rate": 0.0,
        "abnormal/env_failure_rate": 0.6,     # b, c, e
        "abnormal/model_failure_rate": 0.2,   # d
        "abnormal/ok_rate": 0.2,              # a
        "rollout/pass_rate": 0.2,             # a passed; c has no outcome
        "rollout/judged_pass_rate": 0.25,     # 1 of the 4 judged
        "reward/outcome_mean": 0.25,
        "rollout/turns_mean": 2.0,            # 3 + 2 + 1 + 3 + 1
        "rollout/output_tokens_mean": 4.0,    # 10 turns of 2 tokens
        "rollout/length_finish_rate": 0.1,
        "rollout/agent_turns_mean": 1.4, "rollout/planner_turns_mean": 0.4,
        "rollout/synthesizer_turns_mean": 0.2,
        "tools/calls_mean": 1.0, "reward/rubric_failed_turns": 0.0,
        "tools/search_calls": 2.0, "tools/search_error_rate": 0.5,
        "tools/visit_calls": 2.0, "tools/visit_error_rate": 0.5,
        "tools/other_calls": 1.0, "tools/other_error_rate": 1.0,   # "sea rch!" is bucketed
        "reward/planner/rubric_mean": 0.75, "reward/synthesizer/rubric_mean": 0.75,
        # a: outcome 1 + 0.5 * rubric; d: outcome 0, no rubric; b, c, e: env failures, left out
        "reward/planner/turn_reward_mean": (1.25 + 1.5) / 2,
        "reward/synthesizer/turn_reward_mean": 1.375,
        "reward/agent/turn_reward_mean": 0.0,
    }
    assert m == pytest.approx(expected)
    assert set(m) == set(expected)
    logger = MetricsLogger(tmp_path)
    logger.log(3, m, console_keys=("rollout/pass_rate",))
    assert logger.rows() == [{"step": 3, **m}]
    assert taxonomy_metrics([]) == {"rollout/trajectories": 0.0}
