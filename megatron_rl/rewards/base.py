"""The judge protocol, its verdict, and answer extraction.

A judge compares an extracted answer with the reference. `answer=None` means there is no usable
answer (empty, or the trajectory was truncated): every judge scores it 0 without any call. A
judge that itself fails (its endpoint keeps timing out, answers 5xx, says nothing parseable)
returns `error="judge_error"`: an environment failure the caller labels, never a 0 reward.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

JUDGE_ERROR = "judge_error"


@dataclass
class Verdict:
    score: float            # in [0, 1]; meaningless when `error` is set
    correct: bool | None    # None when the judge could not decide
    error: str | None = None  # "judge_error" when the judge itself failed
    detail: str = ""        # why (kept short; safe to log: never holds secrets)


@runtime_checkable
class Judge(Protocol):
    async def judge(self, question: str, answer: str | None, reference: str) -> Verdict: ...


def no_answer(reason: str = "no answer") -> Verdict:
    return Verdict(0.0, False, None, reason)


def judge_failed(detail: str) -> Verdict:
    return Verdict(0.0, None, JUDGE_ERROR, detail)


def references(reference: str) -> list[str]:
    """Acceptable answers: a JSON list of strings (datasets with several golden answers store
    them that way), else the string itself."""
    text = reference.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        if isinstance(items, list) and items and all(isinstance(x, str) for x in items):
            return items
    return [reference]


def clip(text: str, limit: int) -> str:
    """Head and tail of a long text, so a judge prompt stays within its context."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


_THINK = re.compile(r"<think>.*?</think>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.S)
_FINAL = re.compile(r"final\s+answer\s*(?:is)?\s*[*_]*\s*[:：]\s*[*_]*\s*(.+)", re.I)


def strip_thinking(text: str) -> str:
    """Drop closed <think> blocks; an unclosed one (truncated while thinking) drops the rest."""
    text = _THINK.sub("", text)
    cut = text.find("<think>")
    return text if cut < 0 else text[:cut]


def after_thinking(reply: str) -> str | None:
    """A judge reply without its reasoning, or None when it was cut off while thinking (an
    unclosed <think>: whatever it said before may have been a draft). Closed blocks are dropped,
    and so is everything up to a lone </think> (chat templates that open the think block in the
    prompt leave only its end in the reply)."""
    body = _THINK.sub("", reply)
    if "<think>" in body:
        return None
    return body.rsplit("</think>", 1)[-1]


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the output was cut inside the box


def extract_answer(text: str | None) -> str | None:
    """The final answer in a model output, or None when there is none.

    The last `<answer>…</answer>` (a missing close tag is accepted: stop strings are trimmed),
    else the last `\\boxed{…}`, else the rest of the line after the last "Final answer:".
    Thinking blocks are ignored, so a draft answer inside them never counts.
    """
    if not text:
        return None
    body = strip_thinking(text)
    found = [m.group(1) for m in _ANSWER.finditer(body)]
    candidate = found[-1] if found else _last_boxed(body)
    if candidate is None:
        finals = _FINAL.findall(body)
        candidate = finals[-1].strip().rstrip("*_").strip() if finals else None
    if candidate is None or not candidate.strip():
        return None
    return candidate.strip()
