"""One HTTP request → parsed body, or a `ToolError` labelled and marked retryable the same way
for every backend (Serper, Jina, the search service, OpenAI-compatible summarizers)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from megatron_rl.env.base import ErrorLabel, ToolError
from megatron_rl.utils.http import SessionHolder, parse_retry_after
from megatron_rl.utils.secrets import excerpt, redact


class HttpClient:
    """One aiohttp session for the life of the run (see `SessionHolder`); `name` labels errors."""

    def __init__(self, *, connect_timeout_s: float = 10.0, name: str = "HttpClient",
                 max_body_bytes: int = 16 << 20):
        self.connect_timeout_s = connect_timeout_s
        self.max_body_bytes = max_body_bytes  # a page or result past it is refused unread
        self._http = SessionHolder(name, timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s))

    def session(self) -> aiohttp.ClientSession:
        return self._http.get()

    async def close(self) -> None:
        """Close the session; a later request, in any loop, opens a new one."""
        await self._http.close()

    async def request(self, method: str, url: str, *, label: ErrorLabel, where: str,
                      json_body: Any = None, headers: dict[str, str] | None = None,
                      expect: str = "json") -> Any:
        """`expect`: "json" (parsed) or "text". Failures raise ToolError: 429 → rate_limited
        (retryable, Retry-After kept), 5xx / refused or reset connections → `label`
        (retryable), other 4xx and undecodable bodies → `label`. Timeouts propagate as
        TimeoutError for the Guard to label."""
        try:
            async with self.session().request(method, url, json=json_body,
                                              headers=headers) as resp:
                status = resp.status
                declared = resp.content_length
                if declared is not None and declared > self.max_body_bytes:
                    raise ToolError(label, f"{where}: response of {declared} bytes exceeds "
                                    f"the {self.max_body_bytes}-byte cap", status=status)
                raw = await _read_capped(resp, self.max_body_bytes)
                if raw is None:
                    raise ToolError(label, f"{where}: response exceeds the "
                                    f"{self.max_body_bytes}-byte cap", status=status)
                try:
                    body = raw.decode(resp.charset or "utf-8", errors="replace")
                except LookupError:  # a charset name Python does not know
                    body = raw.decode("utf-8", errors="replace")
                retry_after = parse_retry_after(resp.headers.get("Retry-After"))
        except aiohttp.ClientConnectionError as e:
            if isinstance(e, aiohttp.ServerTimeoutError):
                raise TimeoutError(str(e)) from None
            raise ToolError(label, f"{where}: connection failed: {type(e).__name__}: "
                            f"{redact(str(e))}", retryable=True) from None
        except aiohttp.ClientError as e:
            raise ToolError(label, f"{where}: {type(e).__name__}: {redact(str(e))}") from None
        # redacted whole, then cut: a key the server echoes across the cut must not leak in part
        snippet = excerpt(body, 300)
        if status == 429:
            raise ToolError("rate_limited", f"{where}: HTTP 429 rate limited: {snippet}",
                            retryable=True, retry_after_s=retry_after, status=status)
        if status >= 500:
            raise ToolError(label, f"{where}: HTTP {status}: {snippet}", retryable=True,
                            retry_after_s=retry_after, status=status)
        if status >= 400:
            raise ToolError(label, f"{where}: HTTP {status}: {snippet}", status=status)
        if expect == "text":
            return body
        try:
            return json.loads(body)
        except json.JSONDecodeError as e:
            raise ToolError(label, f"{where}: response is not valid JSON ({e}): {snippet}",
                            status=status) from None
        except RecursionError:
            raise ToolError(label, f"{where}: response is JSON nested too deeply",
                            status=status) from None


async def _read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes | None:
    """The whole body, or None as soon as it passes `cap` bytes (the rest is never read)."""
    chunks, size = [], 0
    while chunk := await resp.content.read(min(1 << 20, cap + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            return None
    return b"".join(chunks)
