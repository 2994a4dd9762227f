"""Tools from a recipe's `env` section (the `search` and `visit` entries of the tool registry).

A tool factory takes a `ToolContext` and returns a `Tool`; a user's own is named by import path
in `rl.tools` and gets the same context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.config.schema import EnvConfig
from megatron_rl.env.base import Tool
from megatron_rl.env.reliability import ToolCache, open_cache
from megatron_rl.env.search import SEARCH_PARAMETERS, HttpSearch, LocalSearch, SerperSearch
from megatron_rl.env.visit import (
    VISIT_PARAMETERS,
    ChatSummarizer,
    ExtractiveSummarizer,
    HttpPages,
    JinaReader,
    LocalPages,
    Visit,
)

# the built-in tools' argument schemas by registry name: data rows' `tools_kwargs` are checked
# against them before any tool (or rank, or engine) is built
BUILTIN_PARAMETERS: dict[str, dict[str, Any]] = {"search": SEARCH_PARAMETERS,
                                                 "visit": VISIT_PARAMETERS}


@dataclass
class ToolContext:
    env: EnvConfig = field(default_factory=EnvConfig)
    index: Path | None = None                 # the task's own index (None: the task has none)
    aux_urls: dict[str, list[str]] = field(default_factory=dict)  # aux pools' /v1 base URLs
    cache: ToolCache | None = None            # shared by every tool of the run

    @classmethod
    def open(cls, env: EnvConfig, index: Path | None = None,
             aux_urls: dict[str, list[str]] | None = None) -> ToolContext:
        """The context of a run, with its cache opened (`env.cache` / `env.cache_url_env`)."""
        url: str | None = env.cache
        if env.cache_url_env:
            url = os.environ.get(env.cache_url_env)
            if not url:
                raise ValueError(f"env.cache_url_env={env.cache_url_env!r}: that variable is "
                                 "not set")
        return cls(env, index, dict(aux_urls or {}), open_cache(url, env.cache_ttl_s))


def _local_index(ctx: ToolContext, *candidates: str | None) -> Path:
    for c in candidates:
        if c:
            return Path(c)
    if ctx.index is None:
        raise ValueError("env.search.index: this task has no index of its own; name one built "
                         "with `megatron-rl search build`")
    return ctx.index


def search_tool(ctx: ToolContext) -> Tool:
    s = ctx.env.search
    if s.kind == "http":
        return HttpSearch(s.url, top_k=s.top_k, reliability=s.limits, cache=ctx.cache)
    if s.kind == "serper":
        return SerperSearch(key_env=s.key_env, top_k=s.top_k, reliability=s.limits,
                            cache=ctx.cache)
    return LocalSearch(_local_index(ctx, s.index), top_k=s.top_k, reliability=s.limits,
                       cache=ctx.cache)


def summarizer(ctx: ToolContext) -> Any:
    s = ctx.env.visit.summarizer
    if s.kind == "extractive":
        return ExtractiveSummarizer(max_chars=s.max_chars)
    urls = [s.base_url] if s.base_url else ctx.aux_urls.get(s.pool or "")
    if not urls:
        raise ValueError(f"env.visit.summarizer.pool={s.pool!r}: no such rollout.aux_pools "
                         f"entry; started: {', '.join(ctx.aux_urls) or 'none'}")
    return ChatSummarizer(urls, s.model, key_env=s.key_env, max_tokens=s.max_tokens,
                          reliability=s.limits)


def visit_tool(ctx: ToolContext) -> Tool:
    v = ctx.env.visit
    if v.kind == "http":
        source: Any = HttpPages(v.url)
    elif v.kind == "jina":
        source = JinaReader(key_env=v.key_env)
    else:
        source = LocalPages(_local_index(ctx, v.index, ctx.env.search.index))
    return Visit(source, summarizer(ctx), reliability=v.limits, cache=ctx.cache)
