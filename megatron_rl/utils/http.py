"""HTTP plumbing every client shares: Retry-After parsing, a token-bucket rate limit, and the
loop-bound holders for sessions and locks.

A run uses one event loop for its whole life (the driver runs every phase through one
`asyncio.Runner`), so each client keeps one `aiohttp.ClientSession` for the life of the run.
Asyncio objects belong to the loop that made them: using one from another loop while it is
open or held is a bug, reported with the client's name instead of being silently reopened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from typing import Any, Protocol

import aiohttp


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After is delta-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError):
        return None


def other_loop_error(owner: str, what: str, fix: str) -> RuntimeError:
    return RuntimeError(f"{owner}: its {what} belongs to another event loop; run every phase "
                        f"in one loop, or {fix}")


class SessionHolder:
    """One `aiohttp.ClientSession` for a client, made on first use in the running loop.

    `get()` from another loop while the session is open raises RuntimeError naming `owner`;
    `await close()` closes it, and a later `get()` (from any loop) opens a new one.
    `session_kwargs` go to `aiohttp.ClientSession`.
    """

    def __init__(self, owner: str, **session_kwargs: Any):
        self.owner = owner
        self.session_kwargs = session_kwargs
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def is_open(self) -> bool:
        return self._session is not None and not self._session.closed

    def get(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self.is_open:
            if self._loop is not loop:
                raise other_loop_error(self.owner, "HTTP session", "`await close()` first")
            assert self._session is not None
            return self._session
        self._session, self._loop = aiohttp.ClientSession(**self.session_kwargs), loop
        return self._session

    async def close(self) -> None:
        session, self._session, self._loop = self._session, None, None
        if session is not None and not session.closed:
            await session.close()


class _Acquirable(Protocol):
    async def acquire(self) -> Any: ...
    def release(self) -> None: ...


class LoopBound[A: _Acquirable]:
    """An asyncio lock or semaphore made once, used as `async with`. Another loop may take it
    over only while nobody holds or waits on it (then it gets a fresh one: an idle primitive
    has no state to lose); otherwise RuntimeError naming `owner`."""

    def __init__(self, owner: str, what: str, make: Callable[[], A]):
        self.owner, self.what, self._make = owner, what, make
        self._obj: A | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._users = 0  # holders and waiters, in the loop it is bound to

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        if self._obj is None or self._loop is not loop:
            if self._users:
                raise other_loop_error(self.owner, self.what,
                                       "let its holders finish there first")
            self._obj, self._loop = self._make(), loop
        obj = self._obj
        self._users += 1
        try:
            await obj.acquire()
        except BaseException:
            self._users -= 1
            raise

    async def __aexit__(self, *exc: object) -> None:
        assert self._obj is not None
        self._users -= 1
        self._obj.release()


class TokenBucket:
    """`rate` tokens per second, at most `burst` saved up. Waiters are served in order."""

    def __init__(self, rate: float, burst: int = 1, *, owner: str = "TokenBucket"):
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._lock = LoopBound(owner, "rate-limit lock", asyncio.Lock)

    async def acquire(self) -> None:
        async with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens < 1:
                await asyncio.sleep((1 - self._tokens) / self.rate)
                self._tokens, self._last = 1.0, time.monotonic()
            self._tokens -= 1
