"""GenRM judge: an OpenAI-compatible LLM gives a binary verdict on the extracted answer.

Empty or missing answers score 0 without a call. Calls go through `ChatClient` (concurrency
cap, token bucket, retries with backoff); a reply that says neither "correct" nor "incorrect"
is retried like a transport failure. When the retries are spent the verdict carries
`error="judge_error"` (an environment failure, not a 0).
"""

from __future__ import annotations

import asyncio
import re

from megatron_rl.rewards.base import (
    Verdict,
    clip,
    judge_failed,
    no_answer,
    references,
    strip_thinking,
)
from megatron_rl.utils.chat_client import ChatClient, ClientConfig

GENRM_SYSTEM = "You are a strict grader of answers to factual questions."
GENRM_PROMPT = """\
Decide whether the candidate answer to the question is correct, taking the reference answer as \
the truth. The candidate is correct if it gives the same answer as the reference: paraphrases, \
other formats of the same date, number or name, and extra detail that does not contradict the \
reference are fine. It is incorrect if it gives a different or incomplete answer, hedges \
between several answers, or contradicts the reference.

Question: {question}
Reference answer: {reference}
Candidate answer: {answer}

Reply with one word: correct or incorrect."""

_POSITIVE = {"correct", "right", "true", "yes"}
_WORD = r"(not[\s_]+correct|incorrect|correct|wrong|right|true|false|yes|no)"
_LABELLED = re.compile(r"(?:verdict|judge?ment|grade|decision)\W{0,6}" + _WORD + r"\b")
_FREE = re.compile(r"\b(not[\s_]+correct|incorrect|correct)\b")


def parse_verdict(text: str) -> bool:
    """True/False from a judge reply; ValueError when it says neither.

    A one-word reply ("Correct.", "**INCORRECT**", "yes"); else the last labelled verdict
    ("Verdict: correct", {"verdict": "incorrect"}); else the last free-standing
    correct/incorrect/not correct, so reasoning before the verdict does not count.
    """
    body = strip_thinking(text).lower()
    words = re.sub(r"[^a-z_\s]", " ", body).split()
    if len(words) == 1 and re.fullmatch(_WORD, words[0]):
        return words[0] in _POSITIVE
    for pattern in (_LABELLED, _FREE):
        found = pattern.findall(body)
        if found:
            return found[-1] in _POSITIVE
    raise ValueError(f"unparseable verdict: {text[:200]!r}")


def build_messages(question: str, answer: str, reference: str, prompt: str = GENRM_PROMPT,
                   max_answer_chars: int = 2000) -> list[dict[str, str]]:
    refs = references(reference)
    ref_text = refs[0] if len(refs) == 1 else " | ".join(refs) + " (any one of these)"
    # a degenerate (looping) answer must not overflow the judge's context: that 400 would be
    # labelled judge_error, an environment failure, for what is the policy's fault
    answer = clip(answer, max_answer_chars)
    return [{"role": "system", "content": GENRM_SYSTEM},
            {"role": "user", "content": prompt.format(question=question, reference=ref_text,
                                                      answer=answer)}]


class GenRMJudge:
    def __init__(self, client: ChatClient | ClientConfig, prompt: str = GENRM_PROMPT):
        self.client = client if isinstance(client, ChatClient) else ChatClient(client)
        self.prompt = prompt

    async def judge(self, question: str, answer: str | None, reference: str) -> Verdict:
        if answer is None or not answer.strip():
            return no_answer()
        correct, error = await self.client.call(
            build_messages(question, answer, reference, self.prompt), parse_verdict)
        if correct is None:
            return judge_failed(error or "judge call failed")
        return Verdict(float(correct), correct, None, "correct" if correct else "incorrect")

    async def judge_many(self, items: list[tuple[str, str | None, str]]) -> list[Verdict]:
        """Many (question, answer, reference) at once; the client caps what is in flight."""
        return list(await asyncio.gather(*(self.judge(*item) for item in items)))

    def metrics(self, prefix: str = "judge") -> dict[str, float]:
        return self.client.metrics(prefix)

    async def close(self) -> None:
        await self.client.close()


def genrm_judge(prompt: str | None = None, **client: object) -> GenRMJudge:
    """A GenRM judge from a judge spec: `prompt` and the `ClientConfig` fields (base_url,
    model, api_key_env, limits)."""
    config = ClientConfig.from_dict(client, where="rl.judge (genrm)")
    return GenRMJudge(config, prompt) if prompt else GenRMJudge(config)
