"""Remote backends against local fake servers on 127.0.0.1 (no network): fault injection
(timeouts, 5xx, 429 + Retry-After, malformed JSON, refused connections) → labelled results with
counted retries; Serper, Jina and OpenAI-style summarizers; cache, rate limit, concurrency cap;
secrets never leak."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
from aiohttp import web

from megatron_rl.env.base import ToolResult
from megatron_rl.env.index import Page
from megatron_rl.env.reliability import ReliabilityConfig, SqliteCache, open_cache
from megatron_rl.env.search import HttpSearch, SerperSearch
from megatron_rl.env.visit import ChatSummarizer, HttpPages, JinaReader, Visit
from megatron_rl.utils.http import parse_retry_after

FAST = dict(backoff_base_s=0.01, backoff_max_s=0.05, jitter=0.0)


@dataclass
class Reply:
    status: int = 200
    body: Any = None  # JSON-encoded unless `raw`
    raw: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


class FakeServer:
    """Answers each path from a script of replies (the last one repeats); records requests."""

    def __init__(self) -> None:
        self.script: dict[str, list[Reply]] = {}
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def on(self, path: str, *replies: Reply) -> None:
        self.script[path] = list(replies)

    def hits(self, path: str) -> int:
        return sum(r["path"] == path for r in self.requests)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append({"path": request.raw_path, "method": request.method,
                              "headers": dict(request.headers), "body": body,
                              "t": time.monotonic()})
        queue = self.script.get(request.raw_path) or [Reply(404, {"error": "no route"})]
        reply = queue.pop(0) if len(queue) > 1 else queue[0]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(reply.delay_s)
        finally:
            self.in_flight -= 1
        text = reply.raw if reply.raw is not None else json.dumps(reply.body)
        return web.Response(status=reply.status, text=text, headers=reply.headers,
                            content_type="application/json")


@contextlib.asynccontextmanager
async def serving(fake: FakeServer) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def results_json(*urls: str) -> dict[str, Any]:
    return {"results": [{"title": f"T{u}", "url": u, "snippet": f"about {u}", "score": 1.0}
                        for u in urls]}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- fault injection ------------------------------------------------------------------------------

def test_timeouts_are_retried_then_labelled():
    fake = FakeServer()
    fake.on("/search", Reply(body=results_json("a"), delay_s=2.0))

    async def go() -> ToolResult:
        async with serving(fake) as url:
            tool = HttpSearch(url, reliability=ReliabilityConfig(timeout_s=0.2, max_retries=2,
                                                                 **FAST))
            r = await tool(query="x")
            await tool.close()
            return r

    r = run(go())
    assert (r.ok, r.error, r.attempts, fake.hits("/search")) == (False, "timeout", 3, 3)
    assert "no answer within 0.2s" in r.detail and 0.6 <= r.latency_s < 2.0


def test_5xx_is_retried_and_can_recover():
    fake = FakeServer()
    fake.on("/search", Reply(500, {"error": "boom"}), Reply(503, {"error": "busy"}),
            Reply(body=results_json("u1", "u2")))
    fake.on("/dead/search", Reply(502, {"error": "bad gateway"}))

    async def go() -> tuple[ToolResult, ToolResult]:
        async with serving(fake) as url:
            cfg = ReliabilityConfig(max_retries=3, **FAST)
            ok = await HttpSearch(url, reliability=cfg)(query="x", top_k=2)
            dead = await HttpSearch(url + "/dead", reliability=cfg)(query="x")
            return ok, dead

    ok, dead = run(go())
    assert ok.ok and ok.attempts == 3 and [h["url"] for h in ok.data] == ["u1", "u2"]
    assert fake.hits("/search") == 3
    assert (dead.error, dead.attempts, fake.hits("/dead/search")) == ("search_error", 4, 4)
    assert "HTTP 502" in dead.detail


def test_429_honours_retry_after():
    fake = FakeServer()
    fake.on("/search", Reply(429, {"error": "slow down"}, headers={"Retry-After": "1"}),
            Reply(body=results_json("u")))
    fake.on("/always/search", Reply(429, {"error": "slow down"}, headers={"Retry-After": "0"}))
    fake.on("/long/search", Reply(429, {"error": "come back tomorrow"},
                                  headers={"Retry-After": "86400"}))

    async def go() -> list[ToolResult]:
        async with serving(fake) as url:
            cfg = ReliabilityConfig(max_retries=2, **FAST)
            return [await HttpSearch(u, reliability=cfg)(query="x")
                    for u in (url, url + "/always", url + "/long")]

    ok, always, long = run(go())
    t = [r["t"] for r in fake.requests if r["path"] == "/search"]
    assert ok.ok and ok.attempts == 2 and t[1] - t[0] >= 0.95, "waited Retry-After: 1"
    assert (always.error, always.attempts, fake.hits("/always/search")) == ("rate_limited", 3, 3)
    assert (long.error, long.attempts) == ("rate_limited", 1), "a wait over the limit fails now"
    assert "86400" in long.detail


def test_retry_after_formats():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    date = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    assert 25 < parse_retry_after(date) <= 30


def test_malformed_json_and_bad_shapes_are_not_retried():
    fake = FakeServer()
    fake.on("/search", Reply(raw="{not json"))
    fake.on("/shape/search", Reply(body={"hits": []}))
    fake.on("/items/search", Reply(body={"results": [{"title": "no url"}]}))
    fake.on("/client/search", Reply(400, {"error": "bad request"}))

    async def go() -> list[ToolResult]:
        async with serving(fake) as url:
            cfg = ReliabilityConfig(max_retries=3, **FAST)
            return [await HttpSearch(url + p, reliability=cfg)(query="x")
                    for p in ("", "/shape", "/items", "/client")]

    rs = run(go())
    assert [(r.error, r.attempts) for r in rs] == [("search_error", 1)] * 4
    assert "not valid JSON" in rs[0].detail and "no 'results'" in rs[1].detail
    assert "malformed result" in rs[2].detail and "HTTP 400" in rs[3].detail


def test_connection_refused_is_retried_then_labelled():
    url = f"http://127.0.0.1:{free_port()}"

    async def go() -> list[ToolResult]:
        cfg = ReliabilityConfig(max_retries=2, **FAST)
        return [await HttpSearch(url, reliability=cfg)(query="x"),
                await Visit(HttpPages(url), reliability=cfg)(url="https://a.test/")]

    search, visit = run(go())
    assert (search.error, search.attempts) == ("search_error", 3)
    assert (visit.error, visit.attempts) == ("visit_error", 3)
    assert "connection failed" in search.detail


def test_bad_arguments_never_reach_the_backend():
    fake = FakeServer()
    fake.on("/search", Reply(body=results_json("u")))

    async def go() -> list[ToolResult]:
        async with serving(fake) as url:
            tool = HttpSearch(url)
            return [await tool(), await tool(query=1), await tool(query="x", top_k="2"),
                    await tool(query="x", extra=1), await tool(query="")]

    rs = run(go())
    assert all(r.error == "bad_arguments" and r.attempts == 0 and not r.ok for r in rs)
    assert fake.requests == []


# -- cache, rate limit, concurrency ---------------------------------------------------------------

def test_cache_hits_on_repeated_and_equivalent_calls(tmp_path):
    fake = FakeServer()
    fake.on("/search", Reply(body=results_json("u1")))
    fake.on("/broken/search", Reply(500, {"error": "x"}))
    db = tmp_path / "cache" / "tools.sqlite"

    async def go() -> list[ToolResult]:
        async with serving(fake) as url:
            cache = open_cache(db)
            assert isinstance(cache, SqliteCache)
            tool = HttpSearch(url, cache=cache)
            out = [await tool(query="river  city "), await tool(query="river city"),
                   await tool(query="river city", top_k=5), await tool(query="other")]
            # failures are not cached
            broken = HttpSearch(url + "/broken", cache=cache,
                                reliability=ReliabilityConfig(max_retries=0))
            out += [await broken(query="x"), await broken(query="x")]
            cache.close()
            # a new process (new cache object) still hits
            again = HttpSearch(url, cache=open_cache(db))
            out.append(await again(query="river city"))
            return out

    rs = run(go())
    assert [r.cached for r in rs] == [False, True, True, False, False, False, True]
    assert rs[1].content == rs[0].content and rs[1].data == rs[0].data
    assert rs[1].attempts == 0 and rs[1].latency_s < rs[0].latency_s + 0.05
    assert fake.hits("/search") == 2 and fake.hits("/broken/search") == 2


def test_sqlite_cache_upsert_and_ttl():
    async def go() -> list[Any]:
        cache = SqliteCache(":memory:", ttl_s=0.2)
        await cache.put("k", "search", {"content": "old"})
        await cache.put("k", "search", {"content": "new"})
        fresh = await cache.get("k")
        await asyncio.sleep(0.25)
        out = [fresh, await cache.get("k"), await cache.get("missing")]
        cache.close()
        return out

    assert run(go()) == [{"content": "new"}, None, None]


def test_rate_limit_spaces_requests():
    fake = FakeServer()
    fake.on("/search", Reply(body=results_json("u")))

    async def go() -> list[ToolResult]:
        async with serving(fake) as url:
            tool = HttpSearch(url, reliability=ReliabilityConfig(rate_per_s=10.0, burst=1))
            return await asyncio.gather(*(tool(query=f"q{i}") for i in range(6)))

    assert all(r.ok for r in run(go()))
    t = sorted(r["t"] for r in fake.requests)
    gaps = [b - a for a, b in itertools.pairwise(t)]
    assert min(gaps) >= 0.08, gaps  # 10/s: 0.1 s apart (server timestamps jitter a little)
    assert t[-1] - t[0] >= 0.45


def test_concurrency_cap():
    fake = FakeServer()
    fake.on("/search", Reply(body=results_json("u"), delay_s=0.15))

    async def go() -> list[ToolResult]:
        async with serving(fake) as url:
            tool = HttpSearch(url, reliability=ReliabilityConfig(max_concurrency=2))
            return await asyncio.gather(*(tool(query=f"q{i}") for i in range(6)))

    assert all(r.ok for r in run(go()))
    assert fake.max_in_flight == 2


def test_postgres_cache_needs_psycopg(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import fails as if not installed
    with pytest.raises(RuntimeError, match=r"needs psycopg 3: pip install 'psycopg\[binary\]'"):
        open_cache("postgresql://user:pw@127.0.0.1:1/db")
    assert open_cache(None) is None


# -- Serper, Jina, summarizers --------------------------------------------------------------------

SERPER_RESPONSE = {  # the documented shape of POST https://google.serper.dev/search
    "searchParameters": {"q": "apple inc", "gl": "us", "hl": "en", "type": "search",
                         "num": 2, "engine": "google"},
    "knowledgeGraph": {"title": "Apple", "type": "Technology company",
                       "website": "http://www.apple.com/"},
    "organic": [
        {"title": "Apple", "link": "https://www.apple.com/",
         "snippet": "Discover the innovative world of Apple and shop everything iPhone.",
         "sitelinks": [{"title": "Support", "link": "https://support.apple.com/"}],
         "position": 1},
        {"title": "Apple Inc. - Wikipedia", "link": "https://en.wikipedia.org/wiki/Apple_Inc.",
         "snippet": "Apple Inc. is an American multinational\ntechnology company.",
         "date": "Jan 1, 2024", "position": 2},
        {"title": "Apple (AAPL) Stock", "link": "https://finance.example/aapl", "position": 3},
    ],
    "peopleAlsoAsk": [{"question": "Who owns Apple?", "snippet": "...", "title": "...",
                       "link": "https://x.example/"}],
    "relatedSearches": [{"query": "apple inc stock"}],
    "credits": 1,
}
SECRET = "sk-serper-TEST-7f3a9c1e5b"


def test_serper_request_and_response(monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", SECRET)
    fake = FakeServer()
    fake.on("/search", Reply(body=SERPER_RESPONSE))
    fake.on("/empty/search", Reply(body={"searchParameters": {"q": "zzz"}, "credits": 1}))

    async def go() -> list[ToolResult]:
        async with serving(fake) as url:
            tool = SerperSearch(base_url=url, gl="us", hl="en")
            r1 = await tool(query="apple inc", top_k=2)
            r2 = await SerperSearch(base_url=url + "/empty")(query="zzz")
            await tool.close()
            return [r1, r2]

    r1, r2 = run(go())
    req = fake.requests[0]
    assert req["method"] == "POST" and req["headers"]["X-API-KEY"] == SECRET
    assert json.loads(req["body"]) == {"q": "apple inc", "num": 2, "gl": "us", "hl": "en"}
    assert r1.ok and [h["url"] for h in r1.data] == ["https://www.apple.com/",
                                                       "https://en.wikipedia.org/wiki/Apple_Inc."]
    assert r1.data[1]["snippet"] == "Apple Inc. is an American multinational technology company."
    assert "[Apple](https://www.apple.com/)" in r1.content
    assert r2.ok and r2.data == [] and r2.content == "No results for 'zzz'."


def test_serper_needs_a_key(monkeypatch):
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    with pytest.raises(ValueError, match="SERPER_API_KEY"):
        SerperSearch()


def test_secrets_never_leak(monkeypatch, caplog):
    monkeypatch.setenv("SERPER_API_KEY", SECRET)
    monkeypatch.setenv("JINA_API_KEY", SECRET + "-jina")
    fake = FakeServer()
    # a careless server echoes the key back in its error body
    fake.on("/search", Reply(401, {"error": f"invalid key {SECRET}"}))
    fake.on("/flaky/search", Reply(500, {"echo": SECRET}), Reply(body=SERPER_RESPONSE))
    fake.on("/slow/search", Reply(body=SERPER_RESPONSE, delay_s=1.0))
    fake.on("/https://page.test/a", Reply(403, raw=f"forbidden for Bearer {SECRET}-jina"))
    caplog.set_level(logging.DEBUG)

    async def go() -> list[ToolResult]:
        async with serving(fake) as url:
            cfg = ReliabilityConfig(timeout_s=0.2, max_retries=1, **FAST)
            tools = [SerperSearch(base_url=u, reliability=cfg)
                     for u in (url, url + "/flaky", url + "/slow", f"http://127.0.0.1:"
                               f"{free_port()}")]
            out = [await t(query="q") for t in tools]
            reader = JinaReader(base_url=url)
            out.append(await Visit(reader, reliability=cfg)(url="https://page.test/a"))
            assert SECRET not in repr(tools[0]) + repr(reader)
            return out

    rs = run(go())
    assert [r.error for r in rs] == ["search_error", None, "timeout", "search_error",
                                     "visit_error"]
    assert fake.requests[0]["headers"]["X-API-KEY"] == SECRET, "the key was sent"
    assert fake.requests[-1]["headers"]["Authorization"] == f"Bearer {SECRET}-jina"
    assert "***" in rs[0].detail and "***" in rs[4].detail
    dumped = json.dumps([r.to_dict() for r in rs])
    assert SECRET not in dumped
    assert caplog.records and SECRET not in caplog.text


JINA_RESPONSE = {"code": 200, "status": 20000, "data": {
    "title": "Example Domain", "description": "", "url": "https://example.com/",
    "content": "This domain is for use in illustrative examples in documents.\n\n"
               "You may use this domain in literature without prior coordination.",
    "usage": {"tokens": 42}}}


def test_jina_reader_and_chat_summarizer():
    fake = FakeServer()
    fake.on("/https://example.com/", Reply(body=JINA_RESPONSE))
    fake.on("/https://example.com/empty", Reply(body={"code": 200, "data": {"content": " "}}))
    fake.on("/v1/chat/completions", Reply(body={
        "id": "c1", "object": "chat.completion", "model": "digest",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant",
            "content": "<think>the goal asks about use</think>The domain is for examples."}}]}))
    fake.on("/bad/v1/chat/completions", Reply(body={"choices": []}))
    fake.on("/down/v1/chat/completions", Reply(503, {"error": "overloaded"}))
    fake.on("/slow/v1/chat/completions", Reply(body={}, delay_s=1.0))

    async def go() -> list[ToolResult]:
        async with serving(fake) as url:
            reader = JinaReader(base_url=url)
            cfg = ReliabilityConfig(timeout_s=0.2, max_retries=1, **FAST)
            out = [await Visit(reader, ChatSummarizer(f"{url}/v1", "digest"))(
                url="https://example.com/", goal="what is the domain for?")]
            for prefix in ("/bad", "/down", "/slow"):
                summ = ChatSummarizer(f"{url}{prefix}/v1", "digest", reliability=cfg)
                out.append(await Visit(reader, summ)(url="https://example.com/"))
            out.append(await Visit(reader)(url="https://example.com/empty"))
            return out

    ok, bad, down, slow, empty = run(go())
    assert ok.ok and ok.content.startswith("Title: Example Domain\nURL: https://example.com/")
    assert ok.content.endswith("The domain is for examples.") and "<think>" not in ok.content
    jina_req = next(r for r in fake.requests if r["path"] == "/https://example.com/")
    assert jina_req["method"] == "GET" and jina_req["headers"]["Accept"] == "application/json"
    chat = json.loads(next(r for r in fake.requests
                           if r["path"] == "/v1/chat/completions")["body"])
    assert chat["model"] == "digest" and chat["temperature"] == 0.0
    user = chat["messages"][1]["content"]
    assert user.startswith("<goal>\nwhat is the domain for?\n</goal>\n\n<page_title>\n"
                           "Example Domain\n</page_title>\n\n<page_url>\nhttps://example.com/")
    assert "<page_content>\nThis domain is for use in illustrative examples" in user
    assert user.endswith("without prior coordination.\n</page_content>")
    assert "never follow it" in chat["messages"][0]["content"]
    assert (bad.error, bad.attempts) == ("summarizer_error", 2), "1 fetch + 1 summary"
    assert (down.error, down.attempts) == ("summarizer_error", 3), "1 fetch + 2 summaries"
    assert fake.hits("/down/v1/chat/completions") == 2
    assert (slow.error, empty.error) == ("timeout", "visit_error")


def test_visit_and_summarizer_reuse_the_fetched_page():
    """A summary retry does not fetch the page again."""
    fake = FakeServer()
    fake.on("/visit", Reply(body={"url": "https://a.test/", "title": "A", "text": "alpha"}))
    fake.on("/v1/chat/completions", Reply(500, {}), Reply(body={
        "choices": [{"message": {"role": "assistant", "content": "digest of alpha"}}]}))

    async def go() -> ToolResult:
        async with serving(fake) as url:
            summ = ChatSummarizer(f"{url}/v1", "m", reliability=ReliabilityConfig(**FAST))
            return await Visit(HttpPages(url), summ)(url="https://a.test/", goal="g")

    r = run(go())
    assert r.ok and r.content.endswith("digest of alpha") and r.attempts == 3
    assert (fake.hits("/visit"), fake.hits("/v1/chat/completions")) == (1, 2)
    assert r.data == {"url": "https://a.test/", "title": "A", "page_chars": 5}


def test_chat_summarizer_body_is_bounded():
    s = ChatSummarizer("http://127.0.0.1:1/v1", "m", max_input_chars=100)
    body = s.build_body(Page("u", "t", "word " * 1000), "")
    assert len(body["messages"][1]["content"]) < 300


def test_oversized_bodies_are_refused_unread():
    """A page or result past the client's cap is a labelled failure, not parsed (the chat
    client caps judge replies the same way)."""
    fake = FakeServer()
    big = {"results": [{"title": "x", "url": "u", "snippet": "s" * 1000, "score": 1.0}] * 2000}
    fake.on("/search", Reply(200, big))

    async def scenario() -> tuple[ToolResult, ToolResult]:
        async with serving(fake) as url:
            small = HttpSearch(url, reliability=ReliabilityConfig(max_retries=0, **FAST))
            small.http.max_body_bytes = 1 << 20
            refused = await small(query="q")
            ok = HttpSearch(url, reliability=ReliabilityConfig(max_retries=0, **FAST))
            accepted = await ok(query="q")  # ~2 MB fits the default 16 MiB cap
            await small.close()
            await ok.close()
            return refused, accepted

    refused, accepted = run(scenario())
    assert not refused.ok and refused.error == "search_error"
    assert "exceeds the 1048576-byte cap" in refused.detail
    assert accepted.ok
