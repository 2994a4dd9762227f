"""Tool-call / answer parsing: exact cases, then 10 000 hypothesis cases that must never raise,
and arbitrary (also non-finite, non-Unicode, deep) argument values that must come out as a
bounded call or a labelled failure, strict-JSON writable either way."""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rl.agents.tool_parser import (
    MAX_ARGUMENT_CHARS,
    MAX_ARGUMENT_DEPTH,
    argument_problem,
    load_json,
    parse_action,
    visible_text,
)
from megatron_rl.env.base import validate_arguments
from tests.fakes import DictSearch, DictVisit

SCHEMAS = {t.name: t.parameters for t in (DictSearch({}), DictVisit({}))}
SCHEMAS["lookup"] = {"type": "object", "properties": {
    "k": {"type": "integer", "minimum": 0}, "mode": {"type": "string", "enum": ["a", "b"]},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["k"]}


def call(name: str, **args: object) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_one_and_several_calls_parse_in_order() -> None:
    text = ("<think>look it up</think>\n" + call("search", query="eiffel tower")
            + call("visit", url="https://x.org") + "<|im_end|>")
    act = parse_action(text, SCHEMAS)
    assert act.kind == "tool_calls" and not act.errors
    assert [(c.name, c.arguments) for c in act.calls] == [
        ("search", {"query": "eiffel tower"}), ("visit", {"url": "https://x.org"})]


def test_answer_wins_and_thinking_does_not_act() -> None:
    assert parse_action("<think>maybe <answer>x</answer></think><answer> Paris </answer>",
                        SCHEMAS).answer == "Paris"
    act = parse_action(call("search", query="a") + "<answer>1889</answer>", SCHEMAS)
    assert (act.kind, act.answer, act.calls) == ("answer", "1889", [])
    # a call written inside an unfinished thought is not an action
    assert parse_action("<think>I will " + call("search", query="a"), SCHEMAS).kind == "none"
    assert parse_action("just words, no tags", SCHEMAS).kind == "none"
    assert visible_text("<think>a</think>b<|im_end|>") == "b"


def test_broken_json_is_repaired() -> None:
    for raw in ('{"name": "search", "arguments": {"query": "x"}',      # unclosed
                "{'name': 'search', 'arguments': {'query': 'x'}}",      # single quotes
                '{"name": "search", "arguments": {"query": "x",},}',    # trailing commas
                '{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}'):  # OpenAI string
        act = parse_action(f"<tool_call>{raw}</tool_call>", SCHEMAS)
        assert act.kind == "tool_calls", raw
        assert act.calls[0].arguments == {"query": "x"}, raw
    # an unclosed block at the end of the message (the model stopped early) still counts
    assert parse_action('<tool_call>{"name": "visit", "arguments": {"url": "u"}}',
                        SCHEMAS).calls[0].name == "visit"
    # a list of calls in one block
    act = parse_action('<tool_call>[{"name": "visit", "arguments": {"url": "u"}}, '
                       '{"function": {"name": "search", "arguments": {"query": "q"}}}]'
                       '</tool_call>', SCHEMAS)
    assert [c.name for c in act.calls] == ["visit", "search"]


def test_bad_calls_are_labelled_never_raised() -> None:
    cases = {
        call("browse", url="u"): "unknown tool 'browse'",
        call("search", q="x"): "unknown argument(s) ['q']",
        call("lookup", mode="a"): "missing required argument(s) ['k']",
        call("lookup", k="3"): "must be integer",
        call("lookup", k=-1): "must be >= 0",
        call("lookup", k=1, mode="c"): "must be one of",
        call("lookup", k=1, tags=["a", 2]): "tags[1]",
        call("search", query=""): "must not be empty",
        '<tool_call>{"arguments": {}}</tool_call>': "missing tool name",
        "<tool_call>[]</tool_call>": "empty list",
        "<tool_call>   </tool_call>": "empty <tool_call>",
        '<tool_call>{"name": "search", "arguments": [1]}</tool_call>': "must be a JSON object",
        "<tool_call>" + "x" * 20_000 + "</tool_call>": "longer than",
    }
    for text, message in cases.items():
        act = parse_action(text, SCHEMAS)
        assert act.kind == "parse_error", text[:60]
        (bad,) = act.calls
        assert bad.error == "tool_parse_error" and message in bad.observation, bad.observation
    # one bad call does not spoil a good one next to it
    act = parse_action(call("nope") + call("search", query="ok"), SCHEMAS)
    assert act.kind == "tool_calls" and [c.error for c in act.calls] == ["tool_parse_error", None]


def test_giant_integers_and_deep_nesting_do_not_raise() -> None:
    digits = "9" * 50_000
    assert load_json(digits[:5000]) == digits[:5000]  # past the int limit: kept as text
    act = parse_action('<tool_call>{"name": "lookup", "arguments": {"k": ' + "9" * 5000
                       + "}}</tool_call>", SCHEMAS)
    assert act.kind == "parse_error" and "must be integer" in act.calls[0].observation
    old = sys.get_int_max_str_digits()
    try:  # also with the interpreter's limit lowered or switched off
        for limit in (640, 0):
            sys.set_int_max_str_digits(limit)
            assert parse_action('<tool_call>{"name": "lookup", "arguments": {"k": '
                                + "7" * 9000 + "}}</tool_call>", SCHEMAS).kind == "parse_error"
    finally:
        sys.set_int_max_str_digits(old)
    deep = "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>"
    assert parse_action(deep, SCHEMAS).kind == "parse_error"


# -- fuzzing ------------------------------------------------------------------------------------

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<answer>", "</answer>", "<think>", "</think>", "<|im_end|>",
    "{", "}", "[", "]", '"', "'", ":", ",", "\\", "\\u12", '"name"', '"arguments"',
    '"parameters"', '"function"', '"search"', '"visit"', '"lookup"', '"query"', '"url"', '"k"',
    "null", "true", "NaN", "-Infinity", "1e999", "-0", "9" * 4400, "3.5", "\n", " ", "\x00",
    "\ud7ff", "🙂", "Infinity", '"\\ud800"', "\\udfff", "[" * 20, '{"a": ' * 20,
]
GOOD_ARGS = [("search", {"query": "eiffel tower"}), ("visit", {"url": "https://x.org"}),
             ("lookup", {"k": 3, "mode": "a", "tags": ["t"]})]
ODD_VALUES = [None, True, 0, -1, 2**70, 1.5, float("nan"), "", "3", "<|im_end|>", [], {},
              ["a", 2], {"k": 1}, "x" * 300, float("inf"), [float("-inf")], "a\ud800",
              {"\udc00": 1}, json.loads("[" * 20 + "1" + "]" * 20), "y" * 9000]


def mutated_calls(seed: bytes) -> str:
    """1-4 call blocks built from valid calls, then damaged: odd names, keys and values,
    deleted characters, inserted fragments, cuts, missing closing tags."""
    rng = random.Random(seed)
    blocks = []
    for _ in range(rng.randint(1, 4)):
        name, args = rng.choice(GOOD_ARGS)
        args = dict(args)
        if rng.random() < 0.4:
            args[rng.choice(["query", "url", "k", "mode", "tags", "q"])] = rng.choice(ODD_VALUES)
        if rng.random() < 0.2:
            name = rng.choice(["", "Search", "browse", "x" * 200, "search "])
        obj: object = {"name": name, rng.choice(["arguments"] * 4 + ["parameters"]): args}
        if rng.random() < 0.1:
            obj = rng.choice([[obj, obj], {"function": obj}, args, name])
        body = json.dumps(obj) if rng.random() < 0.9 else repr(obj)
        for _ in range(rng.choice([0, 0, 1, 2, 4])):
            i = rng.randrange(len(body) + 1)
            op = rng.random()
            body = (body[:i] + body[i + 1:] if op < 0.4 else
                    body[:i] + rng.choice(FRAGMENTS) + body[i:] if op < 0.8 else body[:i])
        blocks.append("<tool_call>\n" + body + rng.choice(["\n</tool_call>"] * 3 + [""]))
    head = rng.choice(["", "", "", "<think>plan</think>\n", "<think>", "</think>", "<answer>"])
    return head + rng.choice(["", "\n"]).join(blocks) + rng.choice(["", "<|im_end|>"])


# a third free-form fragment soup, two thirds damaged calls (hypothesis' one_of would favour
# the first branch, hence the explicit choice)
outputs = st.tuples(
    st.binary(min_size=9, max_size=9),
    st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=6), max_size=16).map("".join),
).map(lambda t: t[1] if t[0][0] % 3 == 0 else
       mutated_calls(t[0] + t[1].encode("utf-8", "surrogatepass")))


def check_action(text: str) -> str:
    act = parse_action(text, SCHEMAS)  # must not raise
    assert act.kind in ("answer", "tool_calls", "parse_error", "none")
    if act.kind == "answer":
        assert isinstance(act.answer, str) and not act.calls
    elif act.kind == "none":
        assert not act.calls and act.answer is None
    else:
        assert act.calls and act.answer is None
        assert any(c.error is None for c in act.calls) == (act.kind == "tool_calls")
    for c in act.calls:
        assert isinstance(c.arguments, dict) and isinstance(c.name, str)
        # whatever a call keeps is bounded, plain JSON: dumps and forest commits cannot fail
        assert argument_problem(c.arguments) is None, c.arguments
        json.dumps(c.to_dict(), allow_nan=False)
        json.dumps(c.arguments, ensure_ascii=False).encode("utf-8")
        if c.error is None:
            assert c.name in SCHEMAS and validate_arguments(SCHEMAS[c.name], c.arguments) is None
        else:
            assert c.error == "tool_parse_error" and c.observation.startswith("Error: ")
    return act.kind


def test_fuzz_10k_outputs_never_raise_and_always_classify() -> None:
    seen: Counter[str] = Counter()
    distinct: set[int] = set()

    @settings(max_examples=10_000, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(outputs)
    def fuzz(text: str) -> None:
        seen[check_action(text)] += 1
        distinct.add(hash(text))

    t0 = time.perf_counter()
    fuzz()
    total = sum(seen.values())
    print(f"\nfuzzed {total} outputs ({len(distinct)} distinct) in "
          f"{time.perf_counter() - t0:.1f} s: {dict(seen)}")
    assert total >= 10_000
    assert set(seen) == {"answer", "tool_calls", "parse_error", "none"}


# -- arbitrary argument values ------------------------------------------------------------------

def _depth(x: Any) -> int:
    """Container levels (the arguments object is level 1)."""
    if isinstance(x, dict | list):
        return 1 + max((_depth(v) for v in (x.values() if isinstance(x, dict) else x)),
                       default=0)
    return 0


def _unsafe(x: Any) -> bool:
    """A value no strict, UTF-8 JSON writer takes: NaN/±Infinity, lone surrogates."""
    if isinstance(x, float):
        return not math.isfinite(x)
    if isinstance(x, str):
        return any(0xD800 <= ord(ch) <= 0xDFFF for ch in x)
    if isinstance(x, dict):
        return any(_unsafe(k) or _unsafe(v) for k, v in x.items())
    return isinstance(x, list) and any(_unsafe(v) for v in x)


def _wrap(value: Any, levels: int, as_list: bool) -> Any:
    for i in range(levels):
        value = [value] if as_list else {f"l{i}": value}
    return value


_ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=6)  # surrogates included
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _ANY_TEXT
    | st.sampled_from([math.nan, math.inf, -math.inf, "a\udc00"]),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_ANY_TEXT, kids, max_size=3),
    max_leaves=12)
argument_sets = st.tuples(
    st.sampled_from([*sorted(SCHEMAS), "browse"]),
    st.dictionaries(st.sampled_from(["query", "url", "k", "mode", "tags", "q"]) | _ANY_TEXT,
                    st.tuples(json_values, st.integers(0, 24).map(  # mostly shallow
                        lambda n: n if n >= 20 else n // 5), st.booleans()).map(
                        lambda t: _wrap(*t)), max_size=3),
    st.integers(0, 9).map(lambda n: "z" * (max(n - 6, 0) * MAX_ARGUMENT_CHARS // 2)),
    st.integers(0, 9))  # < 3: a good call of GOOD_ARGS instead (the valid case)


def check_arguments(name: str, args: dict[str, Any]) -> str:
    """Parse one call with these arguments; returns which case it was."""
    text = f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"
    if len(text) > 16_384:  # past the block limit: rejected whole, tested above
        return "too long a block"
    (c,) = parse_action(text, SCHEMAS).calls
    json.dumps(c.to_dict(), allow_nan=False)
    assert c.error in (None, "tool_parse_error")
    reasons = {"non-finite or non-Unicode": _unsafe(args),
               "too deep": _depth(args) > MAX_ARGUMENT_DEPTH,
               "too long": len(json.dumps(args, ensure_ascii=False)) > MAX_ARGUMENT_CHARS}
    if any(reasons.values()):  # refused before any schema check; nothing of it is kept
        assert c.error == "tool_parse_error" and c.arguments == {}, (args, c)
        assert any(w in c.observation for w in (
            "must be finite", "not valid Unicode", "not valid text", "nests deeper than",
            "characters as JSON")), c.observation
        return next(k for k, v in reasons.items() if v)
    # plain JSON: kept as written, valid or not for the tool
    assert c.arguments == args
    valid = name in SCHEMAS and validate_arguments(SCHEMAS[name], args) is None
    assert (c.error is None) == valid
    return "valid" if valid else "schema error"


def test_any_argument_values_give_a_bounded_call_or_a_labelled_failure() -> None:
    seen: Counter[str] = Counter()

    @settings(max_examples=1_500, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(argument_sets)
    def fuzz(case: tuple[str, dict[str, Any], str, int]) -> None:
        name, args, padding, good = case
        if good < 3:
            name, args = GOOD_ARGS[good]
        seen[check_arguments(name, {**args, "query": padding} if padding else args)] += 1

    fuzz()
    print(f"\nargument cases: {dict(seen)}")
    assert {"non-finite or non-Unicode", "too deep", "too long", "valid",
            "schema error"} <= set(seen)


# -- Qwen3.5's XML call syntax -------------------------------------------------------------------

def xml(name: str, **params: str) -> str:
    """A Qwen3.5 call with raw parameter texts, as the model writes them."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_5_calls_parse_with_values_typed_by_the_schema() -> None:
    text = ("<think>two lookups</think>\n\n" + xml("lookup", k="3", mode="a", tags='["x", "y"]')
            + "\n" + xml("search", query="1889\n  two lines ") + "<|im_end|>")
    act = parse_action(text, SCHEMAS)
    assert act.kind == "tool_calls" and not act.errors
    # integer and array parameters are JSON; a string stays text, "1889" and newlines included
    assert [(c.name, c.arguments) for c in act.calls] == [
        ("lookup", {"k": 3, "mode": "a", "tags": ["x", "y"]}),
        ("search", {"query": "1889\n  two lines "})]
    # several functions in one block, an unclosed final </tool_call>, no newlines at all
    act = parse_action("<tool_call><function=visit><parameter=url>u</parameter></function>"
                       "<function=search><parameter=query>q</parameter></function>", SCHEMAS)
    assert [(c.name, c.arguments) for c in act.calls] == [("visit", {"url": "u"}),
                                                          ("search", {"query": "q"})]
    # the released template writes booleans with Python's str(); JSON's are read as well
    schemas = {"flag": {"type": "object", "properties": {"on": {"type": "boolean"},
                                                         "opts": {"type": "object"}}}}
    for raw, want in (("True", True), ("false", False)):
        (c,) = parse_action(xml("flag", on=raw, opts='{"a": [1, 2.5]}'), schemas).calls
        assert c.error is None and c.arguments == {"on": want, "opts": {"a": [1, 2.5]}}
    # a typed value that is not JSON stays text: the schema check names the problem
    (c,) = parse_action(xml("lookup", k="three"), SCHEMAS).calls
    assert c.error == "tool_parse_error" and "must be integer" in c.observation
    # both syntaxes in one message
    assert [c.name for c in parse_action(call("visit", url="u") + xml("search", query="q"),
                                         SCHEMAS).calls] == ["visit", "search"]


def test_malformed_qwen3_5_calls_are_labelled_never_raised() -> None:
    p = "<parameter=query>\nq\n</parameter>\n"
    cases = {
        f"<tool_call>\n<function=search>\n{p}</tool_call>":
            "<function=search> has no closing </function>",
        f"<tool_call>\n<function=search>\n{p}":  # cut: neither closing tag
            "<function=search> has no closing </function>",
        "<tool_call>\n<function=search>\n<parameter=query>\nq\n</function>\n</tool_call>":
            "<parameter=query> in <function=search> has no closing </parameter>",
        f"<tool_call>\n<function=search>\n{p}{p}</function>\n</tool_call>":
            "parameter 'query' given twice in <function=search>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>": "missing tool name",
        "<tool_call>\n<function=search\n</function>\n</tool_call>":
            "a <function=NAME> tag without its closing '>'",
        "<tool_call>\n<function=search>\n<parameter=query\nq</parameter></function>":
            "a <parameter=KEY> tag in <function=search> without its closing '>'",
        "<tool_call>\n<function=search>\n<parameter=>\nq\n</parameter></function>":
            "a <parameter=> without a name",
        f"<tool_call>\n<function=search>\nnow {p}</function>\n</tool_call>":
            "unexpected text in <function=search>: 'now <parameter=query>",
        f"<tool_call>\nsure: <function=search>\n{p}</function>\n</tool_call>":
            "unexpected text before <function=NAME>",
        f"<tool_call>\n<function=browse>\n{p}</function>\n</tool_call>": "unknown tool 'browse'",
        xml("search", q="x"): "unknown argument(s) ['q']",
        xml("lookup", mode="a"): "missing required argument(s) ['k']",
        xml("lookup", k="-1"): "must be >= 0",
    }
    for text, message in cases.items():
        act = parse_action(text, SCHEMAS)
        assert act.kind == "parse_error", text
        (bad,) = act.calls
        assert bad.error == "tool_parse_error" and message in bad.observation, bad.observation
    # a good call before a broken one in the same block is kept
    act = parse_action(f"<tool_call><function=visit><parameter=url>u</parameter></function>"
                       f"<function=search>{p}", SCHEMAS)
    assert [(c.name, c.error) for c in act.calls] == [("visit", None),
                                                      ("search", "tool_parse_error")]


SCORE = {**SCHEMAS, "score": {"type": "object", "properties": {
    "x": {"type": "number"}, "xs": {"type": "array", "items": {"type": "number"}},
    "opts": {"type": "object"}}}}


def test_qwen3_5_calls_keep_the_argument_bounds() -> None:
    def one(text: str) -> Any:
        (c,) = parse_action(text, SCORE).calls
        assert c.error == "tool_parse_error" and c.arguments == {}, c
        json.dumps(c.to_dict(), allow_nan=False)
        return c.observation

    deep = json.dumps(_wrap(1, MAX_ARGUMENT_DEPTH, False))  # an object 16 levels below args
    assert "argument 'opts' nests deeper than 16 levels" in one(xml("score", opts=deep))
    ok = json.dumps(_wrap(1, MAX_ARGUMENT_DEPTH - 1, False))
    assert parse_action(xml("score", opts=ok), SCORE).kind == "tool_calls"
    for literal, shown in (("NaN", "NaN"), ("1e999", "Infinity"), ("-Infinity", "-Infinity")):
        assert f"argument 'x' is {shown}: JSON numbers must be finite" in one(
            xml("score", x=literal))
    assert "argument 'xs[1]' is NaN" in one(xml("score", xs="[1, NaN]"))
    n = MAX_ARGUMENT_CHARS  # {"query": "x…"} is 13 characters more than the text
    assert parse_action(xml("search", query="x" * (n - 13)), SCHEMAS).kind == "tool_calls"
    assert f"arguments are {n + 1} characters as JSON" in one(xml("search", query="x" * (n - 12)))
    assert "longer than 16384" in one(xml("search", query="x" * 17_000))
    assert "not valid Unicode text" in one(xml("search", query="a\ud800b"))
    assert "not valid Unicode text" in one(xml("score", opts='{"a": "\\ud800"}'))
    assert "not valid text" in one(xml("search", **{"\udc00": "x"}))
    assert "must be integer" in parse_action(xml("lookup", k="9" * 5000), SCHEMAS
                                             ).calls[0].observation  # kept as text, not int()
    (c,) = parse_action(xml("se\ud800"), SCHEMAS).calls
    assert c.name == "" and "unknown tool 'se\\ud800'" in c.observation
    # at most MAX_CALLS_PER_BLOCK functions per block, like a JSON list
    many = "<tool_call>" + "<function=visit><parameter=url>u</parameter></function>" * 40
    assert len(parse_action(many, SCHEMAS).calls) == 32


def test_qwen3_5_parsing_is_linear_in_the_block() -> None:
    # thousands of unclosed tags in a block at the size limit: one forward scan, not a regex
    for body in ("<parameter=q>" * 1200, "<function=search>" + "<parameter=a>x</parameter>" * 600
                 + "<parameter=z>"):
        text = "<tool_call>" + body[:16_000]
        t0 = time.perf_counter()
        act = parse_action(text, SCHEMAS)
        assert act.kind == "parse_error" and time.perf_counter() - t0 < 0.5


XML_FRAGMENTS = ["<function=", "</function>", "<parameter=", "</parameter>", ">", "\n", "search",
                 "query", "k", "3", "[1, 2]", '{"a": 1}', "NaN", "True", "<tool_call>",
                 "</tool_call>", "<|im_end|>", "</think>", "\ud800", " "]


def mutated_xml(seed: bytes) -> str:
    """1-3 Qwen3.5 blocks built from valid calls, then damaged like `mutated_calls`."""
    rng = random.Random(seed)
    blocks = []
    for _ in range(rng.randint(1, 3)):
        name, args = rng.choice(GOOD_ARGS)
        params = {k: v if isinstance(v, str) else json.dumps(v) for k, v in args.items()}
        if rng.random() < 0.4:
            params[rng.choice(["query", "url", "k", "mode", "tags", "q"])] = rng.choice(
                ["", "NaN", "1e999", "[" * 30, '"\\ud800"', "x" * 300, "-1", "True", "null"])
        body = xml(name, **params)
        for _ in range(rng.choice([0, 0, 1, 2, 4])):
            i = rng.randrange(len(body) + 1)
            op = rng.random()
            body = (body[:i] + body[i + 1:] if op < 0.4 else
                    body[:i] + rng.choice(XML_FRAGMENTS) + body[i:] if op < 0.8 else body[:i])
        blocks.append(body)
    return rng.choice(["", "<think>plan</think>\n", "<think>"]) + "\n".join(blocks)


def test_fuzz_qwen3_5_calls_never_raise_and_always_classify() -> None:
    seen: Counter[str] = Counter()

    @settings(max_examples=2_000, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.binary(min_size=8, max_size=8))
    def fuzz(seed: bytes) -> None:
        seen[check_action(mutated_xml(seed))] += 1

    fuzz()
    print(f"\nfuzzed {sum(seen.values())} Qwen3.5 outputs: {dict(seen)}")
    assert {"tool_calls", "parse_error", "none"} <= set(seen)
