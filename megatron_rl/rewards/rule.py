"""Rule judge: SQuAD-style normalized exact match and token F1 (the embedded default).

Needs no model and never fails, so it is what small runs and tests use. Several acceptable
answers (a JSON list as the reference) score the best match.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Literal

from megatron_rl.rewards.base import Verdict, no_answer, references

_ARTICLES = re.compile(r"\b(a|an|the)\b")
# ASCII punctuation plus the typographic marks models emit (curly quotes, dashes, ellipsis)
_PUNCT = set(string.punctuation) | set("‘’“”–—…«»")


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace (SQuAD's evaluation)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


class RuleJudge:
    """`metric` picks the score ("em" or "f1"); `correct` is always the exact match."""

    def __init__(self, metric: Literal["em", "f1"] = "em"):
        if metric not in ("em", "f1"):
            raise ValueError(f"RuleJudge metric={metric!r}: 'em' or 'f1'")
        self.metric = metric

    async def judge(self, question: str, answer: str | None, reference: str) -> Verdict:
        if answer is None or not answer.strip():
            return no_answer()
        refs = references(reference)
        em = max(exact_match(answer, r) for r in refs)
        f1 = max(token_f1(answer, r) for r in refs)
        return Verdict(em if self.metric == "em" else f1, em == 1.0, None,
                       f"em={em:g} f1={f1:.3f}")
