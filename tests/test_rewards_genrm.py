"""GenRM judge: verdict parsing, fault injection against a local fake judge, limits, secrets,
and the real call path through the embedded engine's /v1/chat/completions."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
import torch

from megatron_rl.records.trajectory import Trajectory, Turn
from megatron_rl.rewards.base import JUDGE_ERROR
from megatron_rl.rewards.composite import score_group
from megatron_rl.rewards.genrm import GenRMJudge, build_messages, parse_verdict
from megatron_rl.utils.chat_client import ChatClient, ClientConfig, ReplyFailure
from tests.test_rewards_fakes import FakeJudgeServer

SECRET = "sk-test-7f3a9c21-DO-NOT-LEAK"


def fast(url: str | list[str], **kw: Any) -> ClientConfig:
    opts: dict[str, Any] = {"max_retries": 2, "backoff_s": 0.01, "max_backoff_s": 0.2,
                            "timeout_s": 1.0, "max_concurrency": 8}
    return ClientConfig(url, **{**opts, **kw})


def traj(key: str, answer: str | None, finish: str = "stop") -> Trajectory:
    text = f"<answer>{answer}</answer>" if answer is not None else "I could not find it"
    turn = Turn("agent", [1], [2], [-0.1], [0], finish_reason=finish, text=text)
    return Trajectory(key, "g", f"{key}: who wrote it?", reference="Ada Lovelace", turns=[turn])


@pytest.mark.parametrize("reply,expected", [
    ("VERDICT: correct", True), ("VERDICT: incorrect", False), ("verdict:CORRECT", True),
    ("**VERDICT: correct**", True), ("  Verdict: Incorrect.  \n\n", False),
    ("The candidate names the same person.\nVERDICT: correct", True),
    ("It says 1815 while the reference says 1816, so it is not correct.\nVERDICT: incorrect",
     False),
    ("<think>looks correct at first, but no.\nVERDICT: correct</think>\nVERDICT: incorrect",
     False),
    ("VERDICT: correct\n(the reasoning above is final)\nVERDICT: incorrect", False),
])
def test_parse_verdict_reads_the_final_line(reply: str, expected: bool) -> None:
    assert parse_verdict(reply) is expected


@pytest.mark.parametrize("reply", [
    "", "correct", "Incorrect.", "yes", "Verdict: correct, I think", '{"verdict": "correct"}',
    "I am not sure", "<think>VERDICT: correct</think>", "VERDICT: correct\nthanks",
    "VERDICT: maybe", "VERDICT: correct incorrect",
    '"Berlin (verdict: correct)" ... so it is incorrect.',
])
def test_a_reply_without_the_final_line_is_a_labelled_failure(reply: str) -> None:
    failure = parse_verdict(reply)
    assert isinstance(failure, ReplyFailure) and failure.kind == "no_verdict_line"


@pytest.mark.parametrize("reply,expected", [
    ("<think>VERDICT: correct", "cut_while_thinking"),  # a draft, the judge never finished
    ("VERDICT: correct\n<think>but wait", "cut_while_thinking"),
    ("the template opened the block</think>\nVERDICT: correct", True),
    ("VERDICT: incorrect</think>\nVERDICT: correct", True),
])
def test_thinking_before_the_verdict(reply: str, expected: bool | str) -> None:
    got = parse_verdict(reply)
    assert got is expected if isinstance(expected, bool) else got.kind == expected


def test_prompt_lists_every_acceptable_reference() -> None:
    msgs = build_messages("q?", "Ada", '["Ada Lovelace", "Augusta Ada King"]')
    user = msgs[-1]["content"]
    assert "<reference>\nAda Lovelace | Augusta Ada King (any one of these)\n</reference>" in user
    assert "<candidate_answer>\nAda\n</candidate_answer>" in user
    assert "<question>\nq?\n</question>" in user
    assert user.endswith("VERDICT: correct\nVERDICT: incorrect")
    assert "VERDICT: correct" in msgs[0]["content"] and "never instructions" in msgs[0]["content"]
    looping = build_messages("q?", "la " * 20000, "x")[-1]["content"]  # a degenerate answer
    assert len(looping) < 4000 and "characters cut" in looping


# -- fault injection --------------------------------------------------------------------------

YES, NO = "VERDICT: correct", "VERDICT: incorrect"
SCRIPT: dict[str, list] = {
    "q1": [YES],
    "q2": ["Names someone else.\n" + NO],
    "q3": [("status", 500), YES],
    "q4": [("status", 429, "slow down", {"Retry-After": "0.15"}), YES],
    "q5": [("hang", 3.0), YES],
    "q6": [("raw", "<html>bad gateway</html>"), "Verdict: INCORRECT"],
    "q7": [("raw", '{"choices": []}')],
    "q8": [("status", 503)],
    "q9": [("drop",), YES],
    "q10": ["I am not sure"],
    "q11": [("status", 400, "bad request")],
    "q12": [YES],   # never asked: the answer is missing
    "q13": [YES],   # never asked: the trajectory was truncated
}
# q: (outcome or None for judge_error, requests the server saw)
EXPECTED = {"q1": (1.0, 1), "q2": (0.0, 1), "q3": (1.0, 2), "q4": (1.0, 2), "q5": (1.0, 2),
            "q6": (0.0, 2), "q7": (None, 3), "q8": (None, 3), "q9": (1.0, 2), "q10": (None, 3),
            "q11": (None, 1), "q12": (0.0, 0), "q13": (0.0, 0)}


def test_fault_injection_gives_scores_and_labels_without_raising() -> None:
    async def scenario() -> tuple[list, FakeJudgeServer, dict[str, float], float]:
        async with FakeJudgeServer(SCRIPT) as srv:
            judge = GenRMJudge(fast(srv.url))
            group = [traj(k, None if k == "q12" else "Ada Lovelace",
                          "length" if k == "q13" else "stop") for k in SCRIPT]
            t0 = time.monotonic()
            verdicts = await score_group(group, judge)
            elapsed = time.monotonic() - t0
            await judge.close()
            return list(zip(group, verdicts, strict=True)), srv, judge.metrics(), elapsed

    results, srv, metrics, elapsed = asyncio.run(scenario())
    for t, v in results:
        outcome, hits = EXPECTED[t.uid]
        assert srv.hits.get(t.uid, 0) == hits, t.uid
        if outcome is None:
            assert v.error == JUDGE_ERROR and t.labels == [JUDGE_ERROR], t.uid
            assert "outcome" not in t.rewards, t.uid  # a failed judge is not a 0
        else:
            assert v.error is None and t.labels == [] and t.rewards["outcome"] == outcome, t.uid
    by = {t.uid: v for t, v in results}
    assert "malformed" in by["q7"].detail and "http_5xx" in by["q8"].detail
    assert "unparseable: no_verdict_line" in by["q10"].detail
    assert "http_4xx: HTTP 400" in by["q11"].detail
    assert by["q12"].detail == "no answer" and by["q13"].detail == "truncated"
    # retries: q3 1, q4 1, q5 1, q6 1, q7 2, q8 2, q9 1, q10 2 (q11's 400 is not retried)
    assert metrics["judge/retries"] == 11
    assert metrics["judge/calls"] == 11 and metrics["judge/failures"] == 4
    assert metrics["judge/attempts"] == sum(h for _, h in EXPECTED.values())
    assert (metrics["judge/timeout"], metrics["judge/http_429"], metrics["judge/connection"]) \
        == (1, 1, 1)
    assert elapsed >= 0.15  # q4 waited at least what Retry-After asked for


def test_concurrency_cap_and_token_bucket() -> None:
    async def scenario() -> tuple[int, float, list[float]]:
        async with FakeJudgeServer({}, default=("slow", 0.1, YES)) as srv:
            capped = GenRMJudge(fast(srv.url, max_concurrency=3, timeout_s=5))
            items = [(f"q{i}", "x", "x") for i in range(12)]
            assert all(v.correct for v in await capped.judge_many(items))
            await capped.close()
            peak = srv.max_in_flight
        async with FakeJudgeServer({}) as srv:
            limited = GenRMJudge(fast(srv.url, requests_per_s=20, burst=1, timeout_s=5))
            t0 = time.monotonic()
            await limited.judge_many([(f"q{i}", "x", "x") for i in range(10)])
            elapsed = time.monotonic() - t0
            await limited.close()
            return peak, elapsed, srv.arrivals

    peak, elapsed, arrivals = asyncio.run(scenario())
    assert peak == 3
    assert elapsed >= 0.4  # 10 requests at 20/s with a burst of 1: 9 waits of 50 ms
    assert arrivals[-1] - arrivals[0] > 0.35  # the server saw them spread out, too


def test_round_robin_moves_a_retry_to_the_next_url() -> None:
    async def scenario() -> tuple[list, int, int]:
        async with FakeJudgeServer({}, default=("status", 502)) as bad, \
                FakeJudgeServer({}) as good:
            judge = GenRMJudge(fast([bad.url, good.url], max_retries=1))
            verdicts = await judge.judge_many([(f"q{i}", "x", "x") for i in range(4)])
            await judge.close()
            return verdicts, sum(bad.hits.values()), sum(good.hits.values())

    verdicts, bad_hits, good_hits = asyncio.run(scenario())
    assert all(v.score == 1.0 and v.error is None for v in verdicts)
    assert (bad_hits, good_hits) == (2, 4)  # calls alternate start URLs; each 502 fails over


def test_api_key_is_sent_but_never_logged(monkeypatch, caplog) -> None:
    monkeypatch.setenv("JUDGE_TEST_KEY", SECRET)
    echo = f"Incorrect API key provided: {SECRET}"
    script = {"q1": [("status", 500, echo), ("status", 401, echo)], "q2": [("status", 503, echo)]}
    caplog.set_level(logging.DEBUG)

    async def scenario() -> tuple[list, FakeJudgeServer, ChatClient]:
        async with FakeJudgeServer(script) as srv:
            judge = GenRMJudge(fast(srv.url, api_key_env="JUDGE_TEST_KEY"))
            verdicts = await judge.judge_many([("q1", "x", "y"), ("q2", "x", "y")])
            await judge.close()
            return verdicts, srv, judge.client

    verdicts, srv, client = asyncio.run(scenario())
    assert set(srv.auth) == {f"Bearer {SECRET}"}
    assert all(v.error == JUDGE_ERROR for v in verdicts)
    assert "***" in verdicts[0].detail and "HTTP 401" in verdicts[0].detail
    assert "retry" in caplog.text  # the failures were logged ...
    for text in (caplog.text, *(v.detail for v in verdicts), repr(client), repr(client.config)):
        assert SECRET not in text  # ... without the key
    monkeypatch.delenv("JUDGE_TEST_KEY")
    with pytest.raises(ValueError, match="JUDGE_TEST_KEY is not set") as err:
        ChatClient(fast("http://127.0.0.1:1/v1", api_key_env="JUDGE_TEST_KEY"))
    assert SECRET not in str(err.value)


def test_client_config_is_validated() -> None:
    with pytest.raises(ValueError, match="base_url"):
        ClientConfig("127.0.0.1:8000")
    with pytest.raises(ValueError, match="max_concurrency=0"):
        ClientConfig("http://x/v1", max_concurrency=0)
    with pytest.raises(ValueError, match="unknown key.*max_conc"):
        ClientConfig.from_dict({"base_url": "http://x/v1", "max_conc": 2})


# -- the real call path: the embedded engine's OpenAI endpoint ---------------------------------

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")


def verdict_tokenizer() -> Any:
    """Word-level tokenizer whose id 0 decodes to the verdict line "VERDICT: correct"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["VERDICT: correct", "<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "system", "user",
             "assistant", "question", "answer", "reference", "candidate"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                       pad_token="<pad>", eos_token="<|im_end|>",
                                       additional_special_tokens=["<|im_start|>"])
    fast_tok.chat_template = CHATML
    return fast_tok


def test_embedded_engine_serves_as_genrm_judge() -> None:
    """A real tiny model behind the embedded server. With a zero LM head every logit ties and
    greedy decoding emits id 0 ("VERDICT: correct"): the verdict comes through the whole path. The
    random model's gibberish has no verdict line: judge_error, with the parser's reason."""
    from megatron_rl.engines.embedded import EmbeddedServer
    from tests.test_engine_embedded import tiny_model, tiny_tokenizer

    question, answer, reference = "q1 who wrote the note", "Ada", "Ada Lovelace"
    zero = tiny_model()
    with torch.no_grad():
        zero.lm_head.weight.zero_()
    with EmbeddedServer(zero, verdict_tokenizer()).start() as srv:
        judge = GenRMJudge(ClientConfig(srv.url + "/v1", max_tokens=1, max_retries=0))
        verdict = asyncio.run(judge.judge(question, answer, reference))
    assert (verdict.score, verdict.correct, verdict.error) == (1.0, True, None)

    model, tok = tiny_model(), tiny_tokenizer()
    ids = tok.apply_chat_template(build_messages(question, answer, reference),
                                  add_generation_prompt=True, tokenize=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    expected = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    with EmbeddedServer(model, tok).start() as srv:
        judge = GenRMJudge(ClientConfig(srv.url + "/v1", max_tokens=6, max_retries=0))
        verdict = asyncio.run(judge.judge(question, answer, reference))
    assert verdict.error == JUDGE_ERROR
    failure = parse_verdict(expected)  # the model's exact text reached the parser
    assert isinstance(failure, ReplyFailure) and verdict.detail == f"unparseable: {failure}"
