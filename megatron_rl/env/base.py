"""The tool protocol of the deep-search environment.

A tool call must never crash a rollout: every tool returns a `ToolResult`, and a failure comes
back with `ok=False` and one label from `ERROR_LABELS`, so rewards, metrics and the agent's
observation can tell a bad query from a dead backend. Arguments come from a model, so they are
validated against the tool's JSON schema first (`bad_arguments`, never an exception).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol, runtime_checkable

ErrorLabel = Literal["search_error", "visit_error", "summarizer_error", "timeout", "rate_limited",
                     "bad_arguments"]
ERROR_LABELS: frozenset[str] = frozenset(ErrorLabel.__args__)  # type: ignore[attr-defined]


@dataclass
class ToolResult:
    ok: bool
    content: str  # what the agent observes (also on failure: a short, readable message)
    error: ErrorLabel | None = None
    detail: str = ""  # for humans and logs; secrets are redacted before it is set
    latency_s: float = 0.0
    cached: bool = False
    attempts: int = 0  # requests made to the backend (0: cache hit or rejected arguments)
    data: Any = None  # structured payload (search hits, page metadata), JSON-serialisable

    def __post_init__(self) -> None:
        if self.error is not None and self.error not in ERROR_LABELS:
            raise ValueError(f"unknown tool error label {self.error!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def failure(cls, label: ErrorLabel, detail: str, *, tool: str = "tool", latency_s: float = 0.0,
                attempts: int = 0) -> ToolResult:
        return cls(ok=False, content=f"[{tool} failed: {label}] {detail}", error=label,
                   detail=detail, latency_s=latency_s, attempts=attempts)


class ToolError(Exception):
    """Raised inside tools and backends; the tool wrapper turns it into a labelled result.

    `retryable` marks transient failures (timeouts, 5xx, 429, refused connections);
    `retry_after_s` carries a server's Retry-After.
    """

    def __init__(self, label: ErrorLabel, detail: str, *, retryable: bool = False,
                 retry_after_s: float | None = None, status: int | None = None):
        super().__init__(detail)
        if label not in ERROR_LABELS:
            raise ValueError(f"unknown tool error label {label!r}")
        self.label: ErrorLabel = label
        self.detail = detail
        self.retryable = retryable
        self.retry_after_s = retry_after_s
        self.status = status
        self.attempts = 0  # set by the retry loop


@runtime_checkable
class Tool(Protocol):
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema (type=object) of the arguments; shown in the prompt

    async def __call__(self, /, **arguments: Any) -> ToolResult: ...


def tool_spec(tool: Tool) -> dict[str, Any]:
    """The OpenAI-style function description used in system prompts and chat templates."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters}}


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,),
}


def _check_value(name: str, value: Any, schema: dict[str, Any]) -> str | None:
    kind = schema.get("type")
    if kind is not None:
        # bool is an int in Python but not in JSON; a float NaN is no number an API accepts
        is_bool = isinstance(value, bool)
        if (not isinstance(value, _JSON_TYPES[kind]) or (is_bool and kind != "boolean")
                or (isinstance(value, float) and not math.isfinite(value))):
            return f"argument {name!r} must be {kind}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"argument {name!r} must be one of {schema['enum']}, got {value!r}"
    if kind in ("integer", "number"):
        if "minimum" in schema and value < schema["minimum"]:
            return f"argument {name!r} must be >= {schema['minimum']}, got {value}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"argument {name!r} must be <= {schema['maximum']}, got {value}"
    if kind == "string" and len(value.strip()) < schema.get("minLength", 0):
        return f"argument {name!r} must not be empty"
    if kind == "array" and "items" in schema:
        for i, item in enumerate(value):
            if (msg := _check_value(f"{name}[{i}]", item, schema["items"])) is not None:
                return msg
    return None


def validate_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """Check `arguments` against the subset of JSON schema tools use (types, required, enum,
    bounds, no unknown keys). Returns an error message for the agent, or None."""
    props: dict[str, Any] = schema.get("properties", {})
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        return f"unknown argument(s) {unknown}; expected {sorted(props)}"
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    for key, value in arguments.items():
        if (msg := _check_value(key, value, props[key])) is not None:
            return msg
    return None


# The running episode's per-row tool arguments (a data row's `tools_kwargs`): {tool: {arg: v}}.
# A context variable, so each episode (its own asyncio task) sees its own row's, and agents need
# not carry them.
_ROW_ARGUMENTS: ContextVar[Mapping[str, Mapping[str, Any]] | None] = ContextVar(
    "row_tool_arguments", default=None)


@contextlib.contextmanager
def row_arguments(arguments: Mapping[str, Mapping[str, Any]] | None) -> Iterator[None]:
    """Within this block (an episode), tool calls get `arguments[tool.name]` on top of the
    model's: the row's values win."""
    token = _ROW_ARGUMENTS.set(arguments)
    try:
        yield
    finally:
        _ROW_ARGUMENTS.reset(token)


def with_row_arguments(tool: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """A call's arguments with the running episode's fixed ones for `tool` applied."""
    fixed = _ROW_ARGUMENTS.get()
    return {**arguments, **fixed.get(tool, {})} if fixed else dict(arguments)
