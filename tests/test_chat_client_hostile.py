"""The judge client's own settings and its reply-body decoder against hostile input.

A judge section (`rl.judge`, `rl.rubric`) is a free-form mapping, so its client settings are
checked by `ClientConfig`: a NaN or infinite number, or an `extra_body` that cannot be sent as
JSON (YAML's `!!binary` gives bytes), fails when the judge is built, naming the field; and
`ChatClient.call` never raises for a request it cannot serialise. Last, a hypothesis fuzz of the
reply-body decoder: every body decodes to the message text or a labelled, retryable failure.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rl.config.loader import load_config
from megatron_rl.rewards.composite import build_judge, build_rubric
from megatron_rl.utils import chat_client
from megatron_rl.utils.chat_client import ChatClient, ClientConfig

URL = "http://127.0.0.1:9/v1"  # never reached: every case here fails before sending


# -- G2: client settings are finite, in range and JSON ------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("temperature", ".nan"), ("temperature", "-.inf"), ("timeout_s", ".nan"),
    ("timeout_s", ".inf"), ("backoff_s", ".nan"), ("max_backoff_s", ".nan"),
    ("max_backoff_s", ".inf"), ("requests_per_s", ".nan"), ("requests_per_s", ".inf"),
    ("timeout_s", "0"), ("temperature", "true"), ("max_retries", "2.5"), ("burst", ".nan"),
])
def test_a_non_finite_judge_setting_fails_at_setup_naming_the_field(field, value) -> None:
    cfg = load_config(None, [f"rl.judge={{kind: genrm, base_url: '{URL}', {field}: {value}}}",
                             f"rl.rubric={{kind: llm, base_url: '{URL}', {field}: {value}}}"])
    with pytest.raises(ValueError, match=rf"^rl\.judge \(genrm\): {field}=") as judge:
        build_judge(cfg.rl.judge)
    with pytest.raises(ValueError, match=rf"^rl\.rubric: {field}=") as rubric:
        build_rubric(cfg.rl.rubric)
    assert "must be" in str(judge.value) and "must be" in str(rubric.value)


@pytest.mark.parametrize("extra", ["{a: !!binary aGk=}", "{a: !!set {x, y}}", "{a: 2024-01-02}",
                                   "{a: .nan}", "{a: [1, .inf]}", "{1: x}"])
def test_an_extra_body_that_is_not_json_fails_at_setup(extra: str) -> None:
    cfg = load_config(None, [f"rl.judge={{kind: genrm, base_url: '{URL}', extra_body: {extra}}}"])
    with pytest.raises(ValueError, match=r"^rl\.judge \(genrm\): extra_body"):
        build_judge(cfg.rl.judge)


def test_good_settings_still_build() -> None:
    cfg = load_config(None, [f"rl.judge={{kind: genrm, base_url: ['{URL}', '{URL}'], "
                             "temperature: 0.7, timeout_s: 30, requests_per_s: 2.5, "
                             "extra_body: {chat_template_kwargs: {enable_thinking: false}}}"])
    judge = build_judge(cfg.rl.judge)
    assert judge.client.config.extra_body == {"chat_template_kwargs": {"enable_thinking": False}}
    assert ClientConfig(URL, timeout_s=1, backoff_s=0).timeout_s == 1


def test_a_key_with_control_characters_is_refused_by_name(monkeypatch) -> None:
    monkeypatch.setenv("HOSTILE_KEY", "sk-abc\r\nX-Injected: 1")
    with pytest.raises(ValueError, match="HOSTILE_KEY holds whitespace") as err:
        ChatClient(ClientConfig(URL, api_key_env="HOSTILE_KEY"))
    assert "sk-abc" not in str(err.value)


@pytest.mark.parametrize("poison", [b"bytes", math.nan, {1, 2}, object()])
def test_call_never_raises_for_a_body_it_cannot_serialise(poison: Any) -> None:
    """extra_body mutated after validation (or messages from a buggy caller): a labelled,
    counted failure, not a TypeError out of `call`."""
    config = ClientConfig(URL, max_retries=2, backoff_s=0.0)
    config.extra_body["x"] = poison

    async def scenario() -> tuple[Any, Any]:
        client = ChatClient(config)
        got = await client.call([{"role": "user", "content": "q"}], lambda t: t)
        bad_msgs = await client.call([{"role": "user", "content": b"raw"}], lambda t: t)  # type: ignore[dict-item]
        await client.close()
        return (got, bad_msgs), client.metrics()

    (got, bad_msgs), metrics = asyncio.run(scenario())
    for value, why in (got, bad_msgs):
        assert value is None and why.startswith("bad_request: request body is not JSON"), why
    assert metrics["judge/bad_request"] == 2 and metrics["judge/failures"] == 2
    assert "judge/attempts" not in metrics  # refused before a slot, a token or a connection


# -- G8: a fuzz of the reply-body decoder --------------------------------------------------------

KINDS = {"bad_utf8", "bad_json", "not_object", "malformed"}
_TOKENS = [b"{", b"}", b"[", b"]", b'"choices"', b'"message"', b'"content"', b":", b", ",
           b'"x"', b"null", b"1", b"1e999", b"NaN", b"-Infinity", b"\xff", b"\xc3", b"\xef\xbb\xbf",
           b'"\\ud800"', b'"\\u0000"', b"9" * 5000, b" ", b"true", b'"text"']
_CODES = "".join(chr(0x4E00 + i) for i in range(len(_TOKENS)))
_SPELL = {c: t for c, t in zip(_CODES, _TOKENS, strict=True)}
# JSON-ish bytes (mostly broken, some valid, some not UTF-8) from one text draw
jsonish = st.text(alphabet=_CODES, max_size=30).map(lambda t: b"".join(_SPELL[c] for c in t))
leaf = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10)
values = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(["choices", "message", "content", "a"]),
                                        inner, max_size=3), max_leaves=6)


def _completion(content: Any, choice_extra: Any, shape: int) -> bytes:
    message: Any = {"role": "assistant", "content": content}
    choices: Any = [{"index": 0, "message": message, "x": choice_extra}]
    if shape == 1:
        choices = [message]  # no message key
    elif shape == 2:
        choices = {"0": choices[0]}  # not a list
    elif shape == 3:
        choices = []
    return json.dumps({"id": "c", "choices": choices}).encode()


completions = st.builds(_completion, values, values, st.integers(0, 4))
bodies = st.one_of(
    st.binary(max_size=48),
    jsonish,
    values.map(lambda v: json.dumps(v).encode()),
    completions,
    st.tuples(completions, st.integers(0, 64), st.binary(min_size=1, max_size=3)).map(
        lambda t: t[0][:t[1]] + t[2] + t[0][t[1]:]),  # a corrupted completion
    st.integers(0, 5000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(0, 5000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.text(max_size=30).map(lambda t: _completion(t, None, 0)),
)


def _expected_text(raw: bytes) -> str | None:
    """The message text a correct decoder returns, or None where it must refuse."""
    try:
        data = json.loads(raw.decode("utf-8").removeprefix("\ufeff"))
    except (ValueError, RecursionError):
        return None
    try:
        content = data["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) and isinstance(data, dict) else None


def test_fuzz_reply_bodies_decode_to_text_or_a_labelled_failure() -> None:
    count = {"n": 0, "text": 0}
    kinds: set[str] = set()

    @settings(max_examples=10_000, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(raw=bodies)
    def case(raw: bytes) -> None:
        count["n"] += 1
        try:
            got = chat_client._content(raw)
        except chat_client._Retryable as e:  # anything else escaping fails the test
            assert e.kind in KINDS and str(e), (raw[:200], e.kind, str(e))
            kinds.add(e.kind)
            assert _expected_text(raw) is None, raw[:200]
            return
        count["text"] += 1
        assert isinstance(got, str) and got == _expected_text(raw), raw[:200]

    t0 = time.monotonic()
    case()
    print(f"\nfuzz: {count['n']} reply bodies ({count['text']} decoded; failures {sorted(kinds)})"
          f" in {time.monotonic() - t0:.1f}s")
    assert count["n"] >= 10_000 and count["text"] > 100
    assert kinds == KINDS  # every failure kind was reached, and only those
