"""Rubrics: the shipped files, validation errors naming file and field, judge replies read from
their final JSON object, N/A renormalisation (hand-computed), IterSynth turn contexts, scoring
over HTTP."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from megatron_rl.records.trajectory import ToolCall, Trajectory, Turn
from megatron_rl.rewards.base import JUDGE_ERROR
from megatron_rl.rewards.rubric import (
    ANCHORS,
    RUBRIC_DIR,
    RubricError,
    RubricScorer,
    build_messages,
    itersynth_context,
    load_rubric,
    load_rubrics,
    parse_scores,
)
from megatron_rl.utils.chat_client import ClientConfig, ReplyFailure
from tests.test_rewards_fakes import FakeJudgeServer, rubric_reply


@pytest.fixture(scope="module")
def rubrics():
    return load_rubrics()


def test_shipped_rubrics_have_five_weighted_dimensions_with_anchors(rubrics) -> None:
    assert set(rubrics) == {"planner", "synthesizer"}
    for role, r in rubrics.items():
        assert r.role == role and len(r.dimensions) == 5
        assert sum(d.weight for d in r.dimensions) == pytest.approx(1.0)
        assert all(set(d.anchors) == set(ANCHORS) for d in r.dimensions)
    assert [d.name for d in rubrics["planner"].dimensions] == [
        "query_quality", "non_redundancy", "answer_timing", "answer_grounding", "tool_call_form"]
    assert [d.name for d in rubrics["synthesizer"].dimensions] == [
        "faithfulness", "retention", "relevance", "conciseness", "open_questions"]


def _broken(tmp_path: Path, edit: Any) -> Path:
    data = json.loads((RUBRIC_DIR / "planner.json").read_text())
    edit(data)
    path = tmp_path / "planner.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["dimensions"][0].update(weight=0.15),
     r"dimensions\[\*\]\.weight: weights sum to 0\.9, must sum to 1"),
    (lambda d: d["dimensions"][1]["anchors"].pop("3"),
     r"dimensions\[1\]\.anchors\.3: a non-empty string is required"),
    (lambda d: d["dimensions"][2]["anchors"].update({"N/A": " "}),
     r"dimensions\[2\]\.anchors\.N/A: a non-empty string"),
    (lambda d: d["dimensions"][2]["anchors"].update({"4": "x"}),
     r"dimensions\[2\]\.anchors: unknown score\(s\) 4"),
    (lambda d: d["dimensions"][3].update(weight=-0.2), r"dimensions\[3\]\.weight: -0\.2 must"),
    (lambda d: d["dimensions"][3].update(weight="0.2"), r"dimensions\[3\]\.weight: '0\.2'"),
    (lambda d: d["dimensions"][4].update(name="query_quality"),
     r"dimensions\[4\]\.name: 'query_quality' is repeated"),
    (lambda d: d["dimensions"][0].update(name="Query Quality"),
     r"dimensions\[0\]\.name: 'Query Quality' must be lower_snake_case"),
    (lambda d: d["dimensions"][0].update(scale=5), r"dimensions\[0\]: unknown key\(s\) scale"),
    (lambda d: d.pop("role"), r"planner\.json\.role: a non-empty string"),
    (lambda d: d.update(dimensions=[]), r"planner\.json: dimensions: a non-empty list"),
])
def test_validation_names_file_and_field(tmp_path, edit, message) -> None:
    path = _broken(tmp_path, edit)
    with pytest.raises(RubricError, match=message) as err:
        load_rubric(path)
    assert str(err.value).startswith(str(path))


def test_unreadable_rubric_files(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"role": "planner",\n "dimensions": [}')
    with pytest.raises(RubricError, match=r"bad\.json: not valid JSON \(line 2, column 17"):
        load_rubric(bad)
    with pytest.raises(RubricError, match="no such rubric file"):
        load_rubric(tmp_path / "missing.json")
    twin = tmp_path / "twin.json"
    twin.write_text((RUBRIC_DIR / "planner.json").read_text())
    with pytest.raises(RubricError, match="role 'planner' is already defined by"):
        load_rubrics([RUBRIC_DIR / "planner.json", twin])


# -- weighting: planner weights are .25 .2 .2 .2 .15 ------------------------------------------

def test_weighted_score_renormalises_over_applicable_dimensions(rubrics) -> None:
    planner = rubrics["planner"]
    # a search turn: .25*1 + .2*.5 + .2*.75 + .15*0 = .5 over weight .8 (grounding is N/A)
    assert planner.score({"query_quality": 5, "non_redundancy": 3, "answer_timing": 4,
                          "answer_grounding": None, "tool_call_form": 1}) == pytest.approx(0.625)
    # an answer turn: .2*1 + .2*.5 = .3 over weight .4
    assert planner.score({"query_quality": None, "non_redundancy": None, "answer_timing": 5,
                          "answer_grounding": 3, "tool_call_form": None}) == pytest.approx(0.75)
    assert planner.score(dict.fromkeys(["query_quality", "answer_timing"], 5)) == 1.0
    assert planner.score(dict.fromkeys([d.name for d in planner.dimensions])) is None
    synth = rubrics["synthesizer"]  # .3 .2 .2 .1 .2; all 2s: (2-1)/4 whatever the weights
    assert synth.score(dict.fromkeys([d.name for d in synth.dimensions], 2)) == 0.25


# -- parsing judge replies --------------------------------------------------------------------

PLANNER_KEYS = ["query_quality", "non_redundancy", "answer_timing", "answer_grounding",
                "tool_call_form"]


@pytest.mark.parametrize("reply,scores,problems", [
    ('```json\n{"scores": {"query_quality": 5, "non_redundancy": 4, "answer_timing": 3, '
     '"answer_grounding": "N/A", "tool_call_form": 1}}\n```', [5, 4, 3, None, 1], []),
    ('Here is my grading: {"query_quality": 1} was my draft.\n{"scores": {"Query Quality": '
     '"4/5", "non-redundancy": {"score": 2, "reason": "repeats"}, "answer_timing": null, '
     '"answer_grounding": "n/a", "tool_call_form": "5"}}\n', [4, 2, None, None, 5], []),
    ('{"scores": {"query_quality": 5, "non_redundancy": "N/A", "answer_timing": 4}}',
     [5, None, 4, None, None], ["answer_grounding=missing", "tool_call_form=missing"]),
    ('<think>{"scores": {"query_quality": 1}}</think>{"scores": {"query_quality": 3, '
     '"non_redundancy": 7, "answer_timing": "great", "answer_grounding": 2.5, '
     '"tool_call_form": true}}',
     [3, None, None, 2.5, None],
     ["non_redundancy=7", "answer_timing='great'", "tool_call_form=True"]),
    ('Reasoning first.\n{\n  "scores": {\n    "query_quality": 2,\n    "non_redundancy": 2,'
     '\n    "answer_timing": 2,\n    "answer_grounding": 2,\n    "tool_call_form": 2\n  }\n}',
     [2, 2, 2, 2, 2], []),
])
def test_parse_scores_reads_the_final_object(rubrics, reply, scores, problems) -> None:
    got, bad = parse_scores(reply, rubrics["planner"])
    assert got == dict(zip(PLANNER_KEYS, scores, strict=True))
    assert bad == problems


@pytest.mark.parametrize("reply,kind", [
    ("The turn is fine.", "no_final_json"), ("[1, 2, 3]", "no_final_json"), ("", "no_final_json"),
    ('{"clarity": 5}', "no_scores"),
    ('{"query_quality": 5, "non_redundancy": 4}', "no_scores"),  # the scores object is required
    ('{"scores": {"query_quality": "excellent"}}', "no_usable_score"),
    ('{"scores": {"query_quality": 5, "non_redundancy": "N/A", answer_timing: 4,', "no_final_json"),
    ('{"scores": {"query_quality": 5}}\nHope that helps.', "no_final_json"),
    ('{"scores": {"query_quality": 5}} {"note": 1}', "no_final_json"),  # not at a line start
    ('The page says: {"scores": {"query_quality": 5}}', "no_final_json"),
])
def test_unusable_replies_are_labelled_failures(rubrics, reply, kind) -> None:
    failure = parse_scores(reply, rubrics["planner"])
    assert isinstance(failure, ReplyFailure) and failure.kind == kind


# -- turn contexts and the scorer -------------------------------------------------------------

def _turn(role: str, text: str, calls: list[ToolCall] | None = None) -> Turn:
    return Turn(role, [1], [2], [-0.1], [0], tool_calls=calls or [], text=text)


def itersynth_trajectory() -> Trajectory:
    search = ToolCall("search", {"query": "t1 first computer program author"},
                      observation="Ada Lovelace wrote the first program (Note G, 1843).")
    return Trajectory("u", "g", "q1: who wrote the first computer program?",
                      reference="Ada Lovelace", turns=[
                          _turn("planner", "<think>search</think>t1 search call", [search]),
                          _turn("synthesizer", "t2 Ada Lovelace wrote Note G (1843). Open: none"),
                          _turn("planner", "t3 <answer>Ada Lovelace</answer>"),
                          _turn("agent", "t4 not an IterSynth role"),
                      ])


def test_itersynth_context_rebuilds_what_each_role_saw() -> None:
    t = itersynth_trajectory()
    assert itersynth_context(t, 0) == "Summary so far:\n(empty)"
    assert itersynth_context(t, 1) == (
        "Previous summary:\n(empty)\n\nNew evidence:\n"
        '[search {"query": "t1 first computer program author"}]\n'
        "Ada Lovelace wrote the first program (Note G, 1843).")
    assert itersynth_context(t, 2) == ("Summary so far:\nt2 Ada Lovelace wrote Note G (1843). "
                                       "Open: none")


def test_prompt_shows_role_context_output_and_anchors(rubrics) -> None:
    t = itersynth_trajectory()
    msgs = build_messages(rubrics["planner"], t.question, itersynth_context(t, 0), t.turns[0].text)
    user = msgs[-1]["content"]
    assert "## What the planner wrote\n<turn_output>\nt1 search call\n</turn_output>" in user
    assert "<turn_context>\nSummary so far:\n(empty)\n</turn_context>" in user
    assert "### query_quality (weight 0.25)" in user and "- N/A: The turn issues no search" in user
    assert user.endswith(json.dumps({"scores": dict.fromkeys(PLANNER_KEYS, 3)}))
    long = build_messages(rubrics["planner"], "q", "x" * 50, "y", max_chars=20)[-1]["content"]
    assert "x" * 10 + "\n[... 30 characters cut ...]\n" + "x" * 10 in long


def test_scorer_writes_turn_rewards_and_counts_failures(rubrics) -> None:
    script: dict[str, list] = {
        "t1": [("status", 500), rubric_reply(query_quality=5, non_redundancy=3, answer_timing="N/A",
                                             answer_grounding="N/A", tool_call_form=4)],
        "t2": ["```json\n" + rubric_reply(faithfulness=5, retention="N/A", relevance=4,
                                          conciseness=5, open_questions=3) + "\n```"],
        "t3": ["I refuse to grade this."],
    }

    async def scenario() -> tuple[Trajectory, list, FakeJudgeServer, dict[str, float]]:
        async with FakeJudgeServer(script, key_pattern=r"\b(t\d+)\b") as srv:
            scorer = RubricScorer(ClientConfig(srv.url, max_retries=1, backoff_s=0.01),
                                  rubrics)
            t = itersynth_trajectory()
            results = await scorer.score_trajectory(t)
            await scorer.close()
            return t, results, srv, scorer.metrics()

    t, results, srv, metrics = asyncio.run(scenario())
    planner, synth, answer, agent = t.turns
    # t1: (.25*1 + .2*.5 + .15*.75) / (.25 + .2 + .15)
    assert planner.rewards["rubric"] == pytest.approx(0.4625 / 0.6)
    # t2: (.3*1 + .2*.75 + .1*1 + .2*.5) / (.3 + .2 + .1 + .2)
    assert synth.rewards["rubric"] == pytest.approx(0.65 / 0.8)
    assert results[1].dimensions["retention"] is None and results[1].error is None
    # a failed call: that turn is N/A and counted; the trajectory keeps no label (stays in)
    assert "rubric" not in answer.rewards and answer.labels == []
    assert results[2].error == JUDGE_ERROR and "unparseable" in results[2].detail
    assert t.labels == [] and t.metadata["rubric_failed_turns"] == 1
    assert results[3] is None and agent.rewards == {} and srv.hits.get("t4") is None
    assert dict(srv.hits) == {"t1": 2, "t2": 1, "t3": 2}
    assert metrics["rubric_judge/retries"] == 2 and metrics["rubric_judge/failures"] == 1
    synth_prompt = next(b["messages"][-1]["content"] for b in srv.bodies
                        if "## What the synthesizer wrote\n<turn_output>\nt2"
                        in b["messages"][-1]["content"])
    assert "New evidence:\n[search {&quot;query&quot;" in synth_prompt  # escaped inside its tag
    assert "Note G, 1843" in synth_prompt

