"""A local OpenAI-compatible judge server with scripted faults, shared by the rewards tests.

Each request is keyed by the last match of `key_pattern` (default `q<N>`) in its last message
(the tests put it in the question, or in a turn's text); the key's script is consumed one
action per request, the last action repeating.
Actions: a plain string (the assistant's reply), `("status", code[, body[, headers]])`,
`("hang", seconds)` (reply late, for timeouts), `("raw", body)` (a 200 that is not a
chat.completion; `body` str or bytes, sent as is), `("drop",)` (close the connection without a
reply), `("slow", seconds, text)` (reply after a delay, for concurrency checks),
`("chunked", bytes)` (a 200 sent in chunks without Content-Length: its size shows only while
read), `("call", fn)` (`fn(request body)` returns the action: a judge whose reply depends on
the prompt it got).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import defaultdict
from typing import Any

from aiohttp import web

Action = str | tuple


def completion(text: str) -> dict[str, Any]:
    return {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class FakeJudgeServer:
    def __init__(self, script: dict[str, list[Action]], default: Action = "VERDICT: correct",
                 key_pattern: str = r"\b(q\d+)\b"):
        self.script = {k: list(v) for k, v in script.items()}
        self.default = default
        self.key_pattern = re.compile(key_pattern)
        self.hits: dict[str, int] = defaultdict(int)
        self.auth: list[str | None] = []
        self.bodies: list[dict[str, Any]] = []
        self.arrivals: list[float] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    def _next(self, key: str) -> Action:
        actions = self.script.get(key) or [self.default]
        self.hits[key] += 1
        return actions.pop(0) if len(actions) > 1 else actions[0]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.arrivals.append(time.monotonic())
        self.auth.append(request.headers.get("Authorization"))
        body = await request.json()
        self.bodies.append(body)
        keys = self.key_pattern.findall(body["messages"][-1]["content"])
        action = self._next(keys[-1] if keys else "")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._respond(request, action)
        finally:
            self.in_flight -= 1

    async def _respond(self, request: web.Request, action: Action) -> web.StreamResponse:
        if isinstance(action, str):
            return web.json_response(completion(action))
        kind, *args = action
        if kind == "status":
            code = args[0]
            text = args[1] if len(args) > 1 else "server error"
            headers = args[2] if len(args) > 2 else {}
            return web.Response(status=code, text=text, headers=headers)
        if kind == "hang":
            await asyncio.sleep(args[0])
            return web.json_response(completion("VERDICT: correct"))
        if kind == "slow":
            await asyncio.sleep(args[0])
            return web.json_response(completion(args[1]))
        if kind == "raw":
            if isinstance(args[0], bytes):  # e.g. invalid UTF-8
                return web.Response(body=args[0], content_type="application/json")
            return web.Response(text=args[0], content_type="application/json")
        if kind == "chunked":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            data, step = args[0], 1 << 16
            try:
                for i in range(0, len(data), step):
                    await resp.write(data[i:i + step])
                await resp.write_eof()
            except ConnectionError:  # the client stopped reading: what is being tested
                pass
            return resp
        if kind == "call":
            return await self._respond(request, args[0](self.bodies[-1]))
        if kind == "drop":
            assert request.transport is not None
            request.transport.close()
            return web.Response(text="")
        raise AssertionError(f"unknown action {action!r}")

    async def __aenter__(self) -> FakeJudgeServer:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


def rubric_reply(**scores: Any) -> str:
    return json.dumps({"scores": scores})


def test_fake_server_consumes_a_script_and_repeats_its_last_action() -> None:
    import aiohttp

    async def scenario() -> tuple[list[int], dict[str, int]]:
        async with FakeJudgeServer({"q1": [("status", 500), "correct"]}) as srv, \
                aiohttp.ClientSession() as s:
            statuses = []
            for _ in range(3):
                body = {"messages": [{"role": "user", "content": "q1"}]}
                async with s.post(srv.url + "/chat/completions", json=body) as r:
                    statuses.append(r.status)
            return statuses, dict(srv.hits)

    assert asyncio.run(scenario()) == ([500, 200, 200], {"q1": 3})
