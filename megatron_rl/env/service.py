"""The search service: one process holds the index and many rollout workers query it over HTTP
(`HttpSearch`, `HttpPages`), so the index is opened (and its pages cached by the OS) once.

    POST /search {"query": str, "top_k": int = 5}  → {"results": [{title, url, snippet, score}]}
    POST /visit  {"url": str}                      → {"url", "title", "text"}   (404: no page)
    GET  /health                                   → {"ok": true, "docs": N, "index_id": ...}

Bad requests get 400 with {"error": "..."}. Searches run in a thread pool (tantivy blocks).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from megatron_rl.env.index import SearchIndex

MAX_TOP_K = 50
_INDEX: web.AppKey[SearchIndex] = web.AppKey("index", SearchIndex)
_POOL: web.AppKey[ThreadPoolExecutor] = web.AppKey("pool", ThreadPoolExecutor)


class _BadRequest(Exception):
    pass


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except Exception:
        raise _BadRequest("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise _BadRequest("the body must be a JSON object")
    return body


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _search(request: web.Request) -> web.Response:
    try:
        body = await _body(request)
        query, top_k = body.get("query"), body.get("top_k", 5)
        if not isinstance(query, str) or not query.strip():
            raise _BadRequest("'query' must be a non-empty string")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
            raise _BadRequest(f"'top_k' must be an integer in [1, {MAX_TOP_K}]")
    except _BadRequest as e:
        return _error(400, str(e))
    t0 = time.perf_counter()
    index = request.app[_INDEX]
    hits = await asyncio.get_running_loop().run_in_executor(request.app[_POOL], index.search,
                                                            query, top_k)
    return web.json_response({"results": [h.to_dict() for h in hits],
                              "took_ms": round((time.perf_counter() - t0) * 1e3, 3)})


async def _visit(request: web.Request) -> web.Response:
    try:
        body = await _body(request)
        url = body.get("url")
        if not isinstance(url, str) or not url.strip():
            raise _BadRequest("'url' must be a non-empty string")
    except _BadRequest as e:
        return _error(400, str(e))
    page = await asyncio.get_running_loop().run_in_executor(request.app[_POOL],
                                                            request.app[_INDEX].page, url)
    if page is None:
        return _error(404, f"no page at {url}")
    return web.json_response({"url": page.url, "title": page.title, "text": page.text})


async def _health(request: web.Request) -> web.Response:
    index = request.app[_INDEX]
    return web.json_response({"ok": True, "docs": index.num_docs, "index_id": index.id})


def make_app(index: SearchIndex, *, threads: int | None = None) -> web.Application:
    app = web.Application(client_max_size=1 << 20)
    app[_INDEX] = index
    app[_POOL] = ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 2,
                                    thread_name_prefix="search")

    async def _shutdown(app: web.Application) -> None:
        app[_POOL].shutdown(wait=False)

    app.on_cleanup.append(_shutdown)
    app.router.add_post("/search", _search)
    app.router.add_post("/visit", _visit)
    app.router.add_get("/health", _health)
    return app


async def start_service(index: SearchIndex | str | Path, host: str = "127.0.0.1",
                        port: int = 0, *, threads: int | None = None) -> tuple[web.AppRunner, str]:
    """Start serving in the running loop; returns the runner (`await runner.cleanup()` to stop)
    and the base URL (with the real port when `port=0`)."""
    if not isinstance(index, SearchIndex):
        index = SearchIndex(index)
    runner = web.AppRunner(make_app(index, threads=threads), access_log=None)
    await runner.setup()
    sock = socket.create_server((host, port), reuse_port=False)
    site = web.SockSite(runner, sock)
    await site.start()
    bound_host, bound_port = sock.getsockname()[:2]
    return runner, f"http://{bound_host}:{bound_port}"


def serve(index_dir: str | Path, host: str = "127.0.0.1", port: int = 0, *,
          threads: int | None = None, on_ready: Callable[[str, SearchIndex], None] | None = None
          ) -> None:
    """Serve until SIGINT/SIGTERM."""
    index = SearchIndex(index_dir)

    async def main() -> None:
        runner, url = await start_service(index, host, port, threads=threads)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if on_ready is not None:
            on_ready(url, index)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())
