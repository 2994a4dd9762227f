"""One HTTP session per client for the life of the run (`utils.http.SessionHolder`), and the
loop-bound lock/semaphore (`LoopBound`): another event loop is an error while the session is
open or the primitive held, and fine after `close()` (or once nothing is held)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from megatron_rl.engines.http_client import HttpEngine
from megatron_rl.env.http import HttpClient
from megatron_rl.utils.chat_client import ChatClient, ClientConfig
from megatron_rl.utils.http import LoopBound, TokenBucket


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """A tiny server on its own thread and loop, so it outlives the test's loops."""
    chat = {"choices": [{"message": {"content": "ok"}}]}
    app = web.Application()
    app.router.add_get("/health", lambda r: web.json_response({}))
    app.router.add_post("/v1/chat/completions", lambda r: web.json_response(chat))
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def _engine(url: str) -> tuple[Any, Any, str]:
    eng = HttpEngine(url)
    return eng, lambda: eng.request("GET", "/health"), rf"HttpEngine\({url}\)"


def _chat(url: str) -> tuple[Any, Any, str]:
    client = ChatClient(ClientConfig(url + "/v1", max_retries=0, requests_per_s=100))

    async def call() -> None:
        assert await client.call([{"role": "user", "content": "hi"}], parse=str) == ("ok", None)
    return client, call, r"ChatClient\(urls=\['http://127"


def _env(url: str) -> tuple[Any, Any, str]:
    client = HttpClient(name="search-tool")
    return client, lambda: client.request("GET", url + "/health", label="search_error",
                                          where="health"), "search-tool"


@pytest.mark.parametrize("make", [_engine, _chat, _env], ids=["HttpEngine", "ChatClient",
                                                               "HttpClient"])
def test_one_session_per_loop_until_closed(url: str, make: Any) -> None:
    client, call, name = make(url)

    async def twice_concurrently() -> Any:
        async def one() -> Any:
            await call()
            return client._http.get()
        a, b = await asyncio.gather(one(), one())
        assert id(a) == id(b)  # both coroutines share the one session
        return a

    first = asyncio.run(twice_concurrently())
    with pytest.raises(RuntimeError, match=rf"{name}.*another event loop.*await close\(\)"):
        asyncio.run(call())  # still open, and bound to the first (now finished) loop

    async def close_then_call() -> Any:
        await client.close()  # lets this loop open its own
        await call()
        return client._http.get()

    assert asyncio.run(close_then_call()) is not first and first.closed
    asyncio.run(client.close())  # closed at the end of one run: the next may reuse the client
    asyncio.run(twice_concurrently())
    asyncio.run(client.close())


def test_a_held_lock_refuses_another_loop_and_an_idle_one_moves() -> None:
    lock = LoopBound("judge", "rate-limit lock", asyncio.Lock)

    async def take() -> None:
        async with lock:
            pass

    async def hold_while_another_loop_tries() -> None:
        async with lock:
            with pytest.raises(RuntimeError, match="judge: its rate-limit lock belongs to"):
                await asyncio.to_thread(asyncio.run, take())

    asyncio.run(hold_while_another_loop_tries())
    asyncio.run(take())  # released: a later loop gets it
    bucket = TokenBucket(1000.0, burst=2)
    for _ in range(2):
        asyncio.run(bucket.acquire())
