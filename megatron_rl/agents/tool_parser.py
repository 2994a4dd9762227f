"""Actions from model text: `<tool_call>` blocks or a final `<answer>…</answer>`.

A block holds a call in either family's syntax (`formats.py`), whatever the model: Qwen3's JSON
`{"name": …, "arguments": {…}}`, or Qwen3.5's XML `<function=NAME>` with one
`<parameter=KEY>\\nVALUE\\n</parameter>` per argument, where VALUE is text for a string
parameter of the tool's schema and JSON text otherwise (numbers, lists, objects, booleans; the
released template writes `True`/`False`, read as well). An XML call with a missing closing tag,
a repeated parameter or stray text is a labelled `tool_parse_error`.

The parser never raises: whatever a policy writes, `parse_action` returns one of
  - "answer": the text inside `<answer>` (it wins over tool calls in the same message),
  - "tool_calls": at least one valid call (invalid ones ride along, labelled),
  - "parse_error": call blocks, none valid (each labelled `tool_parse_error`),
  - "none": neither (the message ended without acting).
Broken JSON goes through `json_repair`; unknown tools and arguments that do not match the
tool's JSON schema become a `ToolCall` with `error="tool_parse_error"` and an observation that
tells the model what was wrong. Only text after the last `</think>` counts (an unclosed
`<think>` means the model never got to act).

Arguments are model-written data that ends up in trajectories, checkpoints and prompts, so
before any schema check they must be plain, bounded JSON: at most `MAX_ARGUMENT_DEPTH` levels
deep, at most `MAX_ARGUMENT_CHARS` characters as JSON, finite numbers only (no NaN/Infinity,
whether strict JSON or json_repair produced them) and text that is valid Unicode (no lone
surrogates, which tokenizers refuse). Anything else is a `tool_parse_error` whose `ToolCall`
keeps no arguments, so every `ToolCall` the parser returns can be written with
`json.dumps(..., allow_nan=False)`.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import json_repair

from megatron_rl.env.base import validate_arguments
from megatron_rl.records.trajectory import ToolCall

ActionKind = Literal["answer", "tool_calls", "parse_error", "none"]
PARSE_ERROR = "tool_parse_error"
MAX_BLOCK_CHARS = 16_384     # a longer call is garbage; repairing it could be slow
MAX_CALLS_PER_BLOCK = 32     # a JSON list inside one block; the agent's own limits apply after
MAX_INT_DIGITS = 4300        # CPython's default int/str limit (sys.set_int_max_str_digits)
MAX_ARGUMENT_DEPTH = 16      # the arguments object is level 1; tools take flat values or lists
MAX_ARGUMENT_CHARS = 8_192   # the arguments as JSON; far above any real query or URL list

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|\Z)", re.S)
_END_TOKENS = re.compile(r"(?:<\|im_end\|>|<\|endoftext\|>)+\s*\Z")


@dataclass
class Action:
    kind: ActionKind
    calls: list[ToolCall] = field(default_factory=list)
    answer: str | None = None

    @property
    def errors(self) -> list[ToolCall]:
        return [c for c in self.calls if c.error is not None]


def visible_text(text: str) -> str:
    """The part of a message that acts: after the last `</think>`; nothing if `<think>` is open;
    trailing end-of-turn tokens dropped."""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    elif "<think>" in text:
        return ""
    return _END_TOKENS.sub("", text)


def _int_or_text(digits: str) -> int | str:
    # int() of a huge literal raises past the interpreter's limit (and is quadratic below it
    # when the limit is off): keep such numbers as their text
    limit = sys.get_int_max_str_digits() or MAX_INT_DIGITS
    return int(digits) if len(digits) <= min(limit, MAX_INT_DIGITS) else digits


def load_json(text: str) -> Any:
    """Strict JSON, else json_repair's best reading, else None. Never raises."""
    try:
        return json.loads(text, parse_int=_int_or_text)
    except (ValueError, RecursionError):
        pass
    try:
        out = json_repair.repair_json(text, return_objects=True)
    except Exception:  # any repair failure just means "not JSON"
        return None
    return None if out == "" else out


def _short(value: Any, limit: int = 80) -> str:
    try:
        s = repr(value)
    except ValueError:  # an int past the digit limit
        s = f"<{type(value).__name__}>"
    return s if len(s) <= limit else s[:limit] + "…"


def _is_text(s: str) -> bool:
    """Valid Unicode: a JSON `\\ud800` escape decodes to a lone surrogate, which cannot be
    encoded as UTF-8 (tokenizers raise on it, UTF-8 files refuse it)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}[{json.dumps(key)}]" if parent else key


def _number(x: float) -> str:
    return "NaN" if math.isnan(x) else "Infinity" if x > 0 else "-Infinity"


def argument_problem(arguments: dict[str, Any]) -> str | None:
    """Why `arguments` is not plain, bounded JSON (see the module docstring), naming the
    offending argument; None when it is. Walks at most `MAX_ARGUMENT_DEPTH` levels, without
    recursion, so any parsed structure is safe to check."""
    # (value, its path, the top-level argument it is in, its level)
    stack: list[tuple[Any, str, str, int]] = [(arguments, "", "", 1)]
    while stack:
        value, path, top, depth = stack.pop()
        where = f"argument {_short(path)}" if path else "arguments"
        if isinstance(value, dict | list):
            if depth > MAX_ARGUMENT_DEPTH:
                return f"argument {_short(top)} nests deeper than {MAX_ARGUMENT_DEPTH} levels"
            if isinstance(value, list):
                stack.extend((v, _path(path, i), top, depth + 1) for i, v in enumerate(value))
                continue
            for key, item in value.items():
                if not isinstance(key, str) or not _is_text(key):
                    return f"{where} has a key that is not valid text: {_short(key)}"
                stack.append((item, _path(path, key), top or key, depth + 1))
        elif isinstance(value, float):
            if not math.isfinite(value):
                return f"{where} is {_number(value)}: JSON numbers must be finite"
        elif isinstance(value, str):
            if not _is_text(value):
                return f"{where} is not valid Unicode text (a lone surrogate escape)"
        elif value is not None and not isinstance(value, int):  # bool is an int
            return f"{where} is a {type(value).__name__}, not a JSON value"
    try:
        size = len(json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except (ValueError, TypeError):  # e.g. an int past a lowered digit limit
        return "arguments cannot be written as JSON"
    if size > MAX_ARGUMENT_CHARS:
        return f"arguments are {size} characters as JSON; at most {MAX_ARGUMENT_CHARS}"
    return None


def _error(message: str, name: Any = "", arguments: Any = None) -> ToolCall:
    # only checked arguments reach here; a name is kept only if it is valid text
    return ToolCall(name=name if isinstance(name, str) and _is_text(name) else "",
                    arguments=arguments if isinstance(arguments, dict) else {},
                    error=PARSE_ERROR, observation=f"Error: {message}")


def _call(item: Any, schemas: Mapping[str, dict[str, Any]]) -> ToolCall:
    expected = 'expected {"name": <tool name>, "arguments": {...}}'
    if not isinstance(item, dict):
        return _error(f"a tool call must be a JSON object; {expected}")
    if isinstance(item.get("function"), dict):  # OpenAI style {"function": {...}}
        item = item["function"]
    name = item.get("name")
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        args = {} if not args.strip() else load_json(args)
    if args is None:
        args = {}
    if isinstance(args, dict) and (problem := argument_problem(args)) is not None:
        # checked before anything keeps the arguments: the call keeps none
        label = name if isinstance(name, str) and name in schemas else "tool call"
        return _error(f"{label}: {problem}", name)
    if not isinstance(name, str) or not name:
        return _error(f"missing tool name; {expected}", arguments=args)
    if name not in schemas:
        return _error(f"unknown tool {_short(name)}; available: {sorted(schemas)}", name, args)
    if not isinstance(args, dict):
        return _error(f"arguments of {name} must be a JSON object, got {type(args).__name__}",
                      name)
    try:
        problem = validate_arguments(schemas[name], args)
    except Exception as e:  # a schema the validator does not know: reject
        problem = f"arguments could not be checked ({type(e).__name__})"
    if problem is not None:
        return _error(f"{name}: {problem}", name, args)
    return ToolCall(name=name, arguments=args)


_XML_TYPES = {"integer", "number", "boolean", "array", "object", "null"}


def _xml_value(raw: str, prop: Any) -> Any:
    """An XML parameter's value: text for a string (or untyped) parameter, else its JSON."""
    kind = prop.get("type") if isinstance(prop, dict) else None
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if "string" in kinds or not kinds & _XML_TYPES:
        return raw
    text = raw.strip()
    if "boolean" in kinds and text in ("True", "False"):  # the template's `value | string`
        return text == "True"
    if "null" in kinds and text == "None":
        return None
    try:
        return json.loads(text, parse_int=_int_or_text)
    except (ValueError, RecursionError):
        return raw  # the schema check says what is wrong with it


def _tag(kind: str, name: str) -> str:
    shown = repr(name)[1:-1]  # repr: a lone surrogate stays an escape, never a raw character
    return f"<{kind}={shown if len(shown) <= 40 else shown[:40] + '…'}>"


def _xml_function(raw: str, pos: int) -> tuple[str, dict[str, str], int] | str:
    """One `<function=NAME>…</function>` starting at `pos`: (name, raw parameters, end), or why
    it is malformed. Scans forward only (str.find), so any block is read in linear time."""
    end = raw.find(">", pos)
    name = raw[pos + len("<function="):end] if end != -1 else ""
    if end == -1 or "\n" in name or "<" in name:
        return "a <function=NAME> tag without its closing '>'"
    name = name.strip()
    if not name:
        return "missing tool name in <function=>"
    label = _tag("function", name)
    params: dict[str, str] = {}
    pos = end + 1
    while True:
        while pos < len(raw) and raw[pos].isspace():
            pos += 1
        if raw.startswith("</function>", pos):
            return name, params, pos + len("</function>")
        if pos >= len(raw):
            return f"{label} has no closing </function>"
        if not raw.startswith("<parameter=", pos):
            return f"unexpected text in {label}: {_short(raw[pos:pos + 40])}"
        end = raw.find(">", pos)
        key = raw[pos + len("<parameter="):end] if end != -1 else ""
        if end == -1 or "\n" in key or "<" in key:
            return f"a <parameter=KEY> tag in {label} without its closing '>'"
        key = key.strip()
        close = raw.find("</parameter>", end)
        if not key:
            return f"a <parameter=> without a name in {label}"
        if close == -1:
            return f"{_tag('parameter', key)} in {label} has no closing </parameter>"
        if key in params:
            return f"parameter {_short(key)} given twice in {label}"
        value = raw[end + 1:close]
        value = value[1:] if value.startswith("\n") else value  # the template's own newlines
        params[key] = value[:-1] if value.endswith("\n") else value
        pos = close + len("</parameter>")


def _xml_block(raw: str, schemas: Mapping[str, dict[str, Any]]) -> list[ToolCall]:
    """The `<function=…>` calls of one block (Qwen3.5 syntax), each checked like a JSON call."""
    calls: list[ToolCall] = []
    pos = 0
    while len(calls) < MAX_CALLS_PER_BLOCK:
        while pos < len(raw) and raw[pos].isspace():
            pos += 1
        if pos >= len(raw):
            break
        if not raw.startswith("<function=", pos):
            where = "after </function>" if calls else "before <function=NAME>"
            calls.append(_error(f"unexpected text {where}: {_short(raw[pos:pos + 40])}"))
            break
        parsed = _xml_function(raw, pos)
        if isinstance(parsed, str):
            name = raw[pos + len("<function="):raw.find(">", pos)].strip()
            calls.append(_error(parsed, name if name in schemas else ""))
            break
        name, params, pos = parsed
        props = schemas.get(name, {}).get("properties", {})
        props = props if isinstance(props, dict) else {}
        calls.append(_call({"name": name, "arguments": {
            k: _xml_value(v, props.get(k)) for k, v in params.items()}}, schemas))
    return calls


def _block(raw: str, schemas: Mapping[str, dict[str, Any]]) -> list[ToolCall]:
    raw = raw.strip()
    if not raw:
        return [_error("empty <tool_call> block")]
    if len(raw) > MAX_BLOCK_CHARS:
        return [_error(f"tool call longer than {MAX_BLOCK_CHARS} characters")]
    if "<function=" in raw and not raw.startswith(("{", "[")):
        return _xml_block(raw, schemas)
    obj = load_json(raw)
    if obj is None:
        return [_error("tool call is not JSON")]
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        return [_error("empty list of tool calls")]
    return [_call(item, schemas) for item in items[:MAX_CALLS_PER_BLOCK]]


def parse_action(text: str, schemas: Mapping[str, dict[str, Any]]) -> Action:
    """Parse one finished assistant message. `schemas`: tool name → its JSON schema."""
    try:
        visible = visible_text(text)
        answer = _ANSWER.search(visible)
        if answer is not None:
            return Action("answer", answer=answer.group(1).strip())
        calls = [c for m in _CALL.finditer(visible) for c in _block(m.group(1), schemas)]
    except Exception as e:  # a parser bug must cost one action, not a batch
        return Action("parse_error", [_error(f"unparseable output ({type(e).__name__})")])
    if not calls:
        return Action("none")
    ok = any(c.error is None for c in calls)
    return Action("tool_calls" if ok else "parse_error", calls)
