"""The `search` tool over three backends with one result schema (title, url, snippet, score):

- `LocalSearch`: a tantivy BM25 index folder in this process;
- `HttpSearch`: the search service (`megatron-rl search serve`) shared by many rollout workers;
- `SerperSearch`: Google results from Serper.dev (`SERPER_API_KEY` from the environment).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from megatron_rl.config.schema import SearchConfig
from megatron_rl.env.base import ToolError
from megatron_rl.env.http import HttpClient
from megatron_rl.env.index import SearchHit, SearchIndex
from megatron_rl.env.reliability import ManagedTool, ReliabilityConfig, ToolCache, ToolOutput
from megatron_rl.utils.secrets import excerpt, register_secret

MAX_TOP_K = 20
DEFAULT_TOP_K: int = SearchConfig.top_k  # the one default: env.search.top_k's
SEARCH_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1,
                  "description": "what to look for, in plain words"},
        "top_k": {"type": "integer", "minimum": 1, "maximum": MAX_TOP_K, "default": DEFAULT_TOP_K,
                  "description": "number of results"},
    },
    "required": ["query"],
    "additionalProperties": False,
}
SEARCH_DESCRIPTION = ("Search the web. Returns the top results, each with its title, URL and the "
                      "passage that best matches the query. Use `visit` to read a result.")


def format_hits(query: str, hits: list[SearchHit]) -> str:
    if not hits:
        return f"No results for '{query}'."
    lines = [f"A search for '{query}' found {len(hits)} results:"]
    for i, h in enumerate(hits, 1):
        lines.append(f"{i}. [{h.title}]({h.url})\n   {h.snippet}")
    return "\n".join(lines)


def parse_hits(items: Any, where: str) -> list[SearchHit]:
    """The service's `results` list (and tests' fixtures) → hits; bad shapes are search_errors."""
    if not isinstance(items, list):
        raise ToolError("search_error", f"{where}: expected a list of results, got "
                        f"{type(items).__name__}")
    hits = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("url"), str):
            # redacted whole, then cut: a cut first could keep half of a key that Guard's
            # redact no longer recognises
            raise ToolError("search_error", f"{where}: malformed result "
                                            f"{excerpt(str(item), 200)}")
        hits.append(SearchHit(title=str(item.get("title") or ""), url=item["url"],
                              snippet=str(item.get("snippet") or ""),
                              score=float(item.get("score") or 0.0)))
    return hits


class _SearchTool(ManagedTool):
    name = "search"
    description = SEARCH_DESCRIPTION
    parameters = SEARCH_PARAMETERS
    failure_label = "search_error"

    def __init__(self, *, top_k: int = DEFAULT_TOP_K, reliability: ReliabilityConfig | None = None,
                 cache: ToolCache | None = None):
        """`top_k`: the results a call gets when it does not ask for a number."""
        super().__init__(reliability=reliability, cache=cache)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
            raise ValueError(f"search top_k: {top_k!r} is not an integer in [1, {MAX_TOP_K}]")
        if top_k != DEFAULT_TOP_K:
            props = dict(SEARCH_PARAMETERS["properties"])
            props["top_k"] = {**props["top_k"], "default": top_k}
            self.parameters = {**SEARCH_PARAMETERS, "properties": props}

    async def hits(self, query: str, top_k: int) -> list[SearchHit]:
        raise NotImplementedError

    async def run(self, args: dict[str, Any]) -> ToolOutput:
        query, top_k = args["query"], args["top_k"]
        hits = await self.guard.call(lambda: self.hits(query, top_k))
        return ToolOutput(format_hits(query, hits), [h.to_dict() for h in hits])


class LocalSearch(_SearchTool):
    """BM25 over a local index folder. Searches run in a worker thread (tantivy blocks)."""

    def __init__(self, index: SearchIndex | str | Path, *, top_k: int = DEFAULT_TOP_K,
                 reliability: ReliabilityConfig | None = None, cache: ToolCache | None = None):
        super().__init__(top_k=top_k, reliability=reliability or ReliabilityConfig(max_retries=0),
                         cache=cache)
        self.index = index if isinstance(index, SearchIndex) else SearchIndex(index)

    def cache_namespace(self) -> str:
        return f"search@local:{self.index.id}"

    async def hits(self, query: str, top_k: int) -> list[SearchHit]:
        return await asyncio.to_thread(self.index.search, query, top_k)


class HttpSearch(_SearchTool):
    """Client of the search service: `POST {url}/search {"query", "top_k"}`."""

    def __init__(self, url: str, *, top_k: int = DEFAULT_TOP_K,
                 reliability: ReliabilityConfig | None = None, cache: ToolCache | None = None):
        super().__init__(top_k=top_k, reliability=reliability, cache=cache)
        self.url = url.rstrip("/")
        self.http = HttpClient()

    def cache_namespace(self) -> str:
        return f"search@{self.url}"

    async def hits(self, query: str, top_k: int) -> list[SearchHit]:
        where = f"POST {self.url}/search"
        data = await self.http.request("POST", self.url + "/search", label="search_error",
                                       where=where, json_body={"query": query, "top_k": top_k})
        if not isinstance(data, dict) or "results" not in data:
            raise ToolError("search_error", f"{where}: response has no 'results'")
        return parse_hits(data["results"], where)


class SerperSearch(_SearchTool):
    """Google web results from Serper.dev (`POST {base_url}/search`, `X-API-KEY` header).

    The key is read from the environment variable `key_env` only (never from configs, so it
    never lands in a config dump), registered for redaction, and kept out of `repr`."""

    def __init__(self, *, base_url: str = "https://google.serper.dev",
                 key_env: str = "SERPER_API_KEY", gl: str | None = None, hl: str | None = None,
                 top_k: int = DEFAULT_TOP_K, reliability: ReliabilityConfig | None = None,
                 cache: ToolCache | None = None):
        super().__init__(top_k=top_k, reliability=reliability, cache=cache)
        self._api_key = os.environ.get(key_env, "")
        if not self._api_key:
            raise ValueError(f"SerperSearch needs an API key in the environment variable "
                             f"{key_env}")
        register_secret(self._api_key)
        self.base_url = base_url.rstrip("/")
        self.gl, self.hl = gl, hl
        self.http = HttpClient()

    def __repr__(self) -> str:
        return f"SerperSearch(base_url={self.base_url!r})"

    def cache_namespace(self) -> str:
        return f"search@serper:{self.gl}:{self.hl}"

    def build_request(self, query: str, top_k: int) -> tuple[str, dict[str, str], dict[str, Any]]:
        body: dict[str, Any] = {"q": query, "num": top_k}
        if self.gl:
            body["gl"] = self.gl
        if self.hl:
            body["hl"] = self.hl
        headers = {"X-API-KEY": self._api_key, "Content-Type": "application/json"}
        return self.base_url + "/search", headers, body

    @staticmethod
    def parse_response(data: Any, top_k: int, where: str) -> list[SearchHit]:
        """Serper's `organic` results → hits (no `organic` key: no results)."""
        if not isinstance(data, dict):
            raise ToolError("search_error", f"{where}: expected a JSON object, got "
                            f"{type(data).__name__}")
        organic = data.get("organic", [])
        if not isinstance(organic, list):
            raise ToolError("search_error", f"{where}: 'organic' is not a list")
        hits = []
        for item in organic:
            if isinstance(item, dict) and isinstance(item.get("link"), str):
                hits.append(SearchHit(title=str(item.get("title") or ""), url=item["link"],
                                      snippet=" ".join(str(item.get("snippet") or "").split()),
                                      score=1.0 / float(item.get("position") or len(hits) + 1)))
        return hits[:top_k]

    async def hits(self, query: str, top_k: int) -> list[SearchHit]:
        url, headers, body = self.build_request(query, top_k)
        where = f"POST {url}"
        data = await self.http.request("POST", url, label="search_error", where=where,
                                       json_body=body, headers=headers)
        return self.parse_response(data, top_k, where)
