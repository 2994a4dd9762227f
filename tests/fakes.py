"""Offline stand-ins for tests and smoke runs: a scripted policy behind the `RolloutEngine`
protocol and in-memory search/visit tools (the tiny tokenizer lives in `agents.tokenizer`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from megatron_rl.agents.base import AgentConfig
from megatron_rl.config.schema import AgentLimitsConfig
from megatron_rl.engines.base import (
    EngineError,
    GenerateRequest,
    GenerateResult,
    NoServerControl,
    SamplingParams,
)
from megatron_rl.env.base import ToolResult

Policy = Sequence[str] | Callable[[str], str]


class ScriptedEngine(NoServerControl):
    """A `RolloutEngine` whose policy is a script: reply i is the i-th string (or
    `policy(decoded context)`), tokenized and ended with `<|im_end|>`. A reply longer than the
    request's `max_new_tokens` is cut (`length`) and the next request continues it. Log-probs
    are 0, every token carries the current weight version; requests are kept in `requests`.
    """

    def __init__(self, tokenizer: Any, policy: Policy, *, weight_version: int = 0):
        self.tokenizer = tokenizer
        self.policy = policy
        self._script = None if callable(policy) else iter(list(policy))
        self._version = weight_version
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.requests: list[GenerateRequest] = []
        self._rest: list[int] = []  # the uncut remainder of the last reply

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def mid_reply(self) -> bool:
        """The last reply was cut: the next request continues it."""
        return bool(self._rest)

    def _next_reply(self, context_ids: list[int]) -> list[int]:
        if self._script is None:
            text = self.policy(self.tokenizer.decode(context_ids))  # type: ignore[operator]
        else:
            text = next(self._script, None)
            if text is None:
                raise EngineError("scripted policy has no reply left", endpoint="/generate")
        return [*self.tokenizer.encode(text, add_special_tokens=False), self.end_id]

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self.requests.append(req)
        ids = self._rest or self._next_reply(req.input_ids)
        n = req.sampling.max_new_tokens
        ids, self._rest = ids[:n], ids[n:]
        return GenerateResult(rid=req.rid, output_ids=ids, output_logprobs=[0.0] * len(ids),
                              finish_reason="length" if self._rest else "stop",
                              weight_versions=[self._version] * len(ids),
                              prompt_tokens=len(req.input_ids),
                              text=self.tokenizer.decode(ids))

    async def update_weights_from_tensors(self, named_tensors: Iterable[Any],
                                          weight_version: int) -> None:
        self._version = weight_version

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        self._version = weight_version


class _PagesTool:
    """An in-memory tool over {url: (title, text)} pages."""

    name = ""
    description = ""
    parameters: ClassVar[dict[str, Any]] = {}

    def __init__(self, pages: dict[str, tuple[str, str]]):
        self.pages = pages


def _one_string(key: str) -> dict[str, Any]:
    return {"type": "object", "properties": {key: {"type": "string", "minLength": 1}},
            "required": [key]}


class DictSearch(_PagesTool):
    """`search(query)`: titles, URLs and openings of the pages sharing a word with the query."""

    name = "search"
    description = "Search the web. Returns titles, URLs and snippets of matching pages."
    parameters: ClassVar[dict[str, Any]] = _one_string("query")

    async def __call__(self, /, **arguments: Any) -> ToolResult:
        t0 = time.perf_counter()
        words = set(str(arguments.get("query", "")).lower().split())
        hits = [f"{title}\n{url}\n{text[:120]}" for url, (title, text) in self.pages.items()
                if words & set(f"{title} {text}".lower().split())]
        return ToolResult(ok=True, content="\n\n".join(hits) or "No results.",
                          latency_s=time.perf_counter() - t0)


class DictVisit(_PagesTool):
    """`visit(url)`: the page's text, or a `visit_error` for an unknown URL."""

    name = "visit"
    description = "Open a web page and return its text."
    parameters: ClassVar[dict[str, Any]] = _one_string("url")

    async def __call__(self, /, **arguments: Any) -> ToolResult:
        page = self.pages.get(str(arguments.get("url")))
        if page is None:
            return ToolResult.failure("visit_error", f"no page at {arguments.get('url')}",
                                      tool="visit")
        return ToolResult(ok=True, content=f"{page[0]}\n{page[1]}")


def tool_call_text(name: str, family: str = "qwen3", **arguments: Any) -> str:
    """A tool call in the family's format, as a policy would write it (Qwen3's JSON with ASCII
    escapes, so any value, a lone surrogate too, survives tokenizing)."""
    if family != "qwen3":
        from megatron_rl.agents.formats import chat_family

        return chat_family(family).tool_call(name, arguments)
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


PARIS = "https://en.wikipedia.org/wiki/Paris"
DEMO_PAGES = {
    PARIS: ("Paris", "Paris is the capital and largest city of France."),
    "https://en.wikipedia.org/wiki/Eiffel_Tower": (
        "Eiffel Tower", "The Eiffel Tower in Paris was completed in 1889."),
}


def build_index_cli(root: Any, rows: list[dict[str, Any]]) -> Any:
    """`rows` (id/url/title/text) as a JSONL corpus under `root`, indexed with the real
    `megatron-rl search build`; returns the index folder."""
    import subprocess
    import sys

    (root / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "search", "build",
                           "--corpus", str(root / "corpus.jsonl"), "--out", str(root / "index"),
                           "--no-progress"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{len(rows)} docs" in proc.stdout, proc.stdout
    return root / "index"


def agent_config(**kw: Any) -> AgentConfig:
    """An `AgentConfig` for a test (a run builds it from the recipe: `tasks.base.agent_config`):
    8 turns, a 32k context, default sampling; `kw` overrides, `rl.agent_limits` fields by
    name."""
    names = {f.name for f in dataclasses.fields(AgentLimitsConfig)}
    limits = AgentLimitsConfig(**{k: kw.pop(k) for k in list(kw) if k in names})
    kw.setdefault("limits", limits)
    kw.setdefault("max_turns", 8)
    kw.setdefault("max_context_tokens", 32_768)
    kw.setdefault("sampling", SamplingParams())
    return AgentConfig(**kw)
