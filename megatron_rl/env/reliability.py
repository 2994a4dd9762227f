"""What keeps tool calls cheap and safe under RL load: a result cache, per-tool rate limits and
concurrency caps, retries with exponential backoff, per-attempt timeouts, secret redaction.

`ManagedTool` is the base class of every tool: it validates arguments, consults the cache,
runs the tool's `run()` and turns any exception into a labelled `ToolResult`. Remote calls
inside `run()` go through a `Guard` (one per backend), which applies the limits, the timeout
and the retries of a `ReliabilityConfig`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import json
import logging
import random
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from megatron_rl.config.schema import ReliabilityConfig
from megatron_rl.env.base import (
    ErrorLabel,
    ToolError,
    ToolResult,
    validate_arguments,
    with_row_arguments,
)
from megatron_rl.utils.http import LoopBound, TokenBucket
from megatron_rl.utils.secrets import redact, register_secret

log = logging.getLogger("megatron_rl.env")
T = TypeVar("T")


# -- config ---------------------------------------------------------------------------------------

# -- limits and retries ---------------------------------------------------------------------------

_attempts: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("_attempts",
                                                                             default=None)


class Guard:
    """Rate limit, concurrency cap, per-attempt timeout and retries for one backend."""

    def __init__(self, config: ReliabilityConfig, label: ErrorLabel, name: str):
        self.config = config
        self.label = label  # what an unexpected exception or a timeout-free failure is called
        self.name = name
        self.bucket = TokenBucket(config.rate_per_s, config.burst, owner=name) \
            if config.rate_per_s else None
        cap = config.max_concurrency
        self._slots = LoopBound(name, "concurrency cap", lambda: asyncio.Semaphore(cap)) \
            if cap is not None else contextlib.nullcontext()

    def backoff(self, retry: int) -> float:
        c = self.config
        delay = min(c.backoff_max_s, c.backoff_base_s * 2 ** (retry - 1))
        return delay * (1 + c.jitter * random.random())

    async def _attempt(self, fn: Callable[[], Awaitable[T]]) -> T:
        async with self._slots:
            if self.bucket is not None:
                await self.bucket.acquire()
            counter = _attempts.get()
            if counter is not None:
                counter[0] += 1
            async with asyncio.timeout(self.config.timeout_s):
                return await fn()

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """`fn()` until it succeeds, fails for good, or runs out of retries. Raises ToolError."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._attempt(fn)
            except TimeoutError:
                err = ToolError("timeout", f"{self.name}: no answer within "
                                f"{self.config.timeout_s:g}s", retryable=True)
            except ToolError as e:
                err = e
            except Exception as e:  # a backend bug must not end the rollout either
                err = ToolError(self.label, f"{self.name}: {type(e).__name__}: {e}")
            err.attempts = attempt
            if not err.retryable or attempt > self.config.max_retries:
                raise err
            if err.retry_after_s is not None:
                if err.retry_after_s > self.config.max_retry_after_s:
                    err.detail += (f" (Retry-After {err.retry_after_s:g}s is over the "
                                   f"{self.config.max_retry_after_s:g}s limit)")
                    raise err
                delay = err.retry_after_s
            else:
                delay = self.backoff(attempt)
            log.info("%s: attempt %d failed (%s: %s); retrying in %.2fs", self.name, attempt,
                     err.label, redact(err.detail), delay)
            await asyncio.sleep(delay)


# -- cache ----------------------------------------------------------------------------------------

class ToolCache(Protocol):
    async def get(self, key: str) -> dict[str, Any] | None: ...

    async def put(self, key: str, tool: str, value: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class _SqlCache:
    """One `tool_cache` table behind a DB-API connection; calls run in a worker thread."""

    _param = "?"  # the driver's placeholder
    _real = "REAL"

    def __init__(self, db: Any, ttl_s: float | None):
        self._db = db
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._db.execute("CREATE TABLE IF NOT EXISTS tool_cache (key TEXT PRIMARY KEY, "
                         f"tool TEXT, value TEXT, created {self._real})")

    def _sql(self, query: str) -> str:
        return query.replace("?", self._param)

    def _get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(self._sql("SELECT value, created FROM tool_cache WHERE "
                                             "key = ?"), (key,)).fetchone()
        if row is None or (self.ttl_s is not None and time.time() - row[1] > self.ttl_s):
            return None
        return json.loads(row[0])

    def _put(self, key: str, tool: str, value: dict[str, Any]) -> None:
        # upsert syntax shared by sqlite >= 3.24 and Postgres
        with self._lock:
            self._db.execute(self._sql("INSERT INTO tool_cache VALUES (?, ?, ?, ?) ON CONFLICT "
                                       "(key) DO UPDATE SET value = excluded.value, "
                                       "created = excluded.created"),
                             (key, tool, json.dumps(value), time.time()))

    async def get(self, key: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self._get, key)

    async def put(self, key: str, tool: str, value: dict[str, Any]) -> None:
        await asyncio.to_thread(self._put, key, tool, value)

    def close(self) -> None:
        with self._lock:
            self._db.close()


class SqliteCache(_SqlCache):
    """A sqlite file (WAL, so several rollout processes on one machine can share it)."""

    def __init__(self, path: str | Path, ttl_s: float | None = None):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False, timeout=30,
                             isolation_level=None)
        if self.path != ":memory:":
            db.execute("PRAGMA journal_mode=WAL")
        super().__init__(db, ttl_s)


class PostgresCache(_SqlCache):
    """The same table in Postgres, for rollout workers on many machines (needs psycopg 3)."""

    _param = "%s"
    _real = "DOUBLE PRECISION"

    def __init__(self, url: str, ttl_s: float | None = None):
        try:
            import psycopg
        except ImportError:
            raise RuntimeError("a postgresql:// tool cache needs psycopg 3: "
                               "pip install 'psycopg[binary]'") from None
        try:
            db = psycopg.connect(url, autocommit=True)
        except psycopg.Error as e:
            raise RuntimeError("tool cache: cannot connect to Postgres: "
                               f"{redact(str(e))}") from None
        super().__init__(db, ttl_s)


def open_cache(url: str | Path | None, ttl_s: float | None = None) -> ToolCache | None:
    """None: no cache; `postgresql://…` / `postgres://…`: Postgres; anything else: a sqlite
    file path (or `:memory:`)."""
    if url is None or url == "":
        return None
    url = str(url)
    if url.startswith(("postgresql://", "postgres://")):
        register_secret(_url_password(url))
        return PostgresCache(url, ttl_s)
    return SqliteCache(url.removeprefix("sqlite://"), ttl_s)


def _url_password(url: str) -> str | None:
    from urllib.parse import urlsplit

    return urlsplit(url).password


def normalise_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """Defaults filled in and whitespace collapsed, so equivalent calls share a cache entry."""
    out = {k: p["default"] for k, p in schema.get("properties", {}).items() if "default" in p}
    for k, v in arguments.items():
        out[k] = " ".join(v.split()) if isinstance(v, str) else v
    return out


def cache_key(namespace: str, arguments: dict[str, Any]) -> str:
    blob = json.dumps([namespace, arguments], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


# -- the tool base class --------------------------------------------------------------------------

@dataclass
class ToolOutput:
    content: str
    data: Any = None


class ManagedTool:
    """Base class: subclasses set `name`, `description`, `parameters`, `failure_label` and
    implement `run(args) -> ToolOutput` (raising ToolError on failure)."""

    name: str = "tool"
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}  # noqa: RUF012
    failure_label: ErrorLabel = "search_error"

    def __init__(self, *, reliability: ReliabilityConfig | None = None,
                 cache: ToolCache | None = None):
        self.reliability = reliability or ReliabilityConfig()
        self.guard = Guard(self.reliability, self.failure_label, self.name)
        self.cache = cache

    def cache_namespace(self) -> str:
        """Distinguishes backends in a shared cache (override: index id, endpoint)."""
        return self.name

    async def run(self, args: dict[str, Any]) -> ToolOutput:
        raise NotImplementedError

    async def close(self) -> None:
        """Close HTTP sessions held by the tool or its parts (`http` attributes)."""
        for obj in (self, *vars(self).values()):
            http = getattr(obj, "http", None)
            if http is not None and hasattr(http, "close"):
                await http.close()

    async def __call__(self, /, **arguments: Any) -> ToolResult:
        t0 = time.perf_counter()
        arguments = with_row_arguments(self.name, arguments)  # the data row's tools_kwargs
        problem = validate_arguments(self.parameters, arguments)
        if problem is not None:
            return ToolResult.failure("bad_arguments", problem, tool=self.name,
                                      latency_s=time.perf_counter() - t0)
        args = normalise_arguments(self.parameters, arguments)
        key = cache_key(self.cache_namespace(), args) if self.cache is not None else ""
        if self.cache is not None:
            try:
                hit = await self.cache.get(key)
            except Exception as e:  # a broken cache costs speed, not the rollout
                log.warning("%s: cache read failed: %s", self.name, redact(repr(e)))
                hit = None
            if hit is not None:
                return ToolResult(ok=True, content=hit["content"], data=hit.get("data"),
                                  cached=True, latency_s=time.perf_counter() - t0)
        counter = [0]
        token = _attempts.set(counter)
        try:
            out = await self.run(args)
        except ToolError as e:
            detail = redact(e.detail)
            log.warning("%s failed after %d attempt(s): %s: %s", self.name, counter[0], e.label,
                        detail)
            return ToolResult.failure(e.label, detail, tool=self.name, attempts=counter[0],
                                      latency_s=time.perf_counter() - t0)
        except Exception as e:
            detail = redact(f"{type(e).__name__}: {e}")
            log.warning("%s failed: %s", self.name, detail)
            return ToolResult.failure(self.failure_label, detail, tool=self.name,
                                      attempts=counter[0], latency_s=time.perf_counter() - t0)
        finally:
            _attempts.reset(token)
        if self.cache is not None:
            try:
                await self.cache.put(key, self.name, {"content": out.content, "data": out.data})
            except Exception as e:
                log.warning("%s: cache write failed: %s", self.name, redact(repr(e)))
        return ToolResult(ok=True, content=out.content, data=out.data, attempts=counter[0],
                          latency_s=time.perf_counter() - t0)
