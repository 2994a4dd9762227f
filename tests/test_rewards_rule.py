"""Answer extraction and the rule judge (SQuAD-style EM / token F1), on hand-computed cases."""

from __future__ import annotations

import asyncio

import pytest

from megatron_rl.rewards.base import extract_answer, references
from megatron_rl.rewards.rule import RuleJudge, exact_match, normalize_answer, token_f1


@pytest.mark.parametrize("text,expected", [
    ("<answer>Paris</answer>", "Paris"),
    ("<answer>Rome</answer> then <answer> Paris </answer>", "Paris"),     # the last one
    ("<think><answer>Rome</answer></think><answer>Paris</answer>", "Paris"),
    ("<think>draft: <answer>Rome</answer></think> I need more searching.", None),
    ("<answer>Paris", "Paris"),                   # stop string trimmed the close tag
    ("so \\boxed{3} or rather \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("cut inside \\boxed{\\frac{1}{2", None),
    ("Reasoning...\n**Final Answer:** Ada Lovelace\n", "Ada Lovelace"),
    ("final answer: 12\nFinal answer: 13", "13"),
    ("<think>Final answer: 3", None),             # truncated while thinking
    ("<answer>  </answer>", None),
    ("", None),
    (None, None),
    ("just prose", None),
])
def test_extract_answer(text: str | None, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_normalize_answer() -> None:
    assert normalize_answer("  The Eiffel\tTower! ") == "eiffel tower"
    assert normalize_answer("“Hamlet” — a play…") == "hamlet play"
    assert normalize_answer("An apple, the pear") == "apple pear"
    assert normalize_answer("theory") == "theory"  # articles only as whole words


@pytest.mark.parametrize("pred,ref,em,f1", [
    ("the Eiffel Tower", "Eiffel tower.", 1.0, 1.0),
    ("Eiffel Tower in Paris", "the Eiffel Tower", 0.0, 2 / 3),   # P=2/4, R=2/2
    ("Paris France", "Paris, Texas", 0.0, 0.5),                  # P=R=1/2
    ("x y y z", "y y w", 0.0, 4 / 7),                            # P=2/4, R=2/3 (counts clip)
    ("London", "Paris", 0.0, 0.0),
    ("", "Paris", 0.0, 0.0),
    ("the", "a", 1.0, 1.0),                                      # both normalise to ""
])
def test_exact_match_and_token_f1(pred: str, ref: str, em: float, f1: float) -> None:
    assert exact_match(pred, ref) == em
    assert token_f1(pred, ref) == pytest.approx(f1)


def test_references_accept_a_json_list() -> None:
    assert references('["Ada Lovelace", "Augusta Ada King"]') == ["Ada Lovelace",
                                                                  "Augusta Ada King"]
    assert references("[1, 2]") == ["[1, 2]"]          # not a list of strings: literal
    assert references("[citation needed") == ["[citation needed"]


def test_rule_judge_scores() -> None:
    async def go(judge: RuleJudge, answer: str | None, reference: str):
        return await judge.judge("who?", answer, reference)

    em, f1 = RuleJudge("em"), RuleJudge("f1")
    v = asyncio.run(go(f1, "Eiffel Tower in Paris", "the Eiffel Tower"))
    assert (v.score, v.correct, v.error) == (pytest.approx(2 / 3), False, None)
    assert v.detail == "em=0 f1=0.667"
    assert asyncio.run(go(em, "Eiffel Tower in Paris", "the Eiffel Tower")).score == 0.0
    v = asyncio.run(go(em, "augusta ada king", '["Ada Lovelace", "Augusta Ada King"]'))
    assert (v.score, v.correct) == (1.0, True)
    for empty in (None, "", "   "):
        v = asyncio.run(go(f1, empty, "x"))
        assert (v.score, v.correct, v.error, v.detail) == (0.0, False, None, "no answer")
    with pytest.raises(ValueError, match="metric='bleu'"):
        RuleJudge("bleu")  # type: ignore[arg-type]
