"""The begin / commit of a one-copy weight write over a Unix socket (engines/shared_weights.py).

A trainer on the engine's machine writes the engine's parameters in place between a begin
(hold every step) and a commit (new version, decoding goes on). Over HTTP (the client's and
the server's event loops, aiohttp, the scheduler's hop) the commit took 1.1-1.6 ms after a
449 MB copy had evicted the caches, and the begin outlasted the trainer's 1 ms walk over the
tensors by 0.3-0.5 ms. Here the engine answers on a socket in the abstract namespace (gone
with the process) served by a thread of its own, one JSON line each way: 0.5-0.9 and 0.2-0.3
ms (`benchmarks/weight_sync.py`, one-copy).

Trust is the shared memory's: only a process of the engine's own user may connect (its peer
credentials are checked), as only such a process can open the engine's memory
(`/proc/<pid>/fd`). Every line is untrusted: a long, broken or unknown one gets an error line
naming what was wrong, or the connection is closed; nothing crashes the engine.

    engine:  {"op": "begin"}                          -> {"segment": "<label>"}
    trainer: {"op": "commit", "weight_version": "7"}  -> {"weight_version": "7"}
    either refused:                                   -> {"error": "...", "status": 400}
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from megatron_rl.engines.base import EngineError

MAX_LINE = 4096  # bytes of one request or reply line
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class WriteControlServer:
    """Engine side: a listening socket and one thread per connected trainer. `begin()` returns
    the shared memory's label, `commit(version)` the version now served; either raises with a
    `status` attribute (400 when absent) to refuse."""

    def __init__(self, begin: Callable[[], str], commit: Callable[[Any], Any]):
        self.begin, self.commit = begin, commit
        self.address = f"megatron-rl-weights-{os.getpid()}-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + self.address)
        self.sock.listen(8)
        self.conns: set[socket.socket] = set()
        self.closed = False
        threading.Thread(target=self._accept, name="weight-write-control", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            try:  # one peer's trouble must not stop the accepts: a writer would wait forever
                _, uid, _ = _PEERCRED.unpack(conn.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
                if uid != os.getuid() or self.closed:
                    conn.close()
                    continue
                self.conns.add(conn)
                threading.Thread(target=self._serve, args=(conn,), name="weight-write-control",
                                 daemon=True).start()
            except (OSError, RuntimeError):  # gone already; no thread to be had
                self.conns.discard(conn)
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn, conn.makefile("rb") as lines:
                while line := lines.readline(MAX_LINE + 1):
                    if len(line) > MAX_LINE or not line.endswith(b"\n"):
                        conn.sendall(_line({"error": f"a request line is longer than {MAX_LINE} "
                                                     "bytes", "status": 400}))
                        return  # the rest of it cannot be told from the next request
                    conn.sendall(_line(self._answer(line)))
        except OSError:  # the trainer went away mid-line or the server closed
            pass
        finally:
            self.conns.discard(conn)

    def _answer(self, line: bytes) -> dict[str, Any]:
        try:
            body = json.loads(line)
        except ValueError as e:
            return {"error": f"not a JSON line: {e}", "status": 400}
        op = body.get("op") if isinstance(body, dict) else None
        try:
            if op == "begin":
                return {"segment": self.begin()}
            if op == "commit":
                return {"weight_version": self.commit(body.get("weight_version"))}
        except Exception as e:  # the engine's refusal (or failure) goes back to the writer
            return {"error": f"{op}: {e}"[:MAX_LINE // 2], "status": getattr(e, "status", 500)}
        return {"error": f"op: {str(op)[:100]!r} is not 'begin' or 'commit'", "status": 400}

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for conn in list(self.conns):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def _line(reply: dict[str, Any]) -> bytes:
    return json.dumps(reply).encode() + b"\n"


class WriteControlClient:
    """Trainer side: one connection, opened on first use in the running event loop (another
    loop opens its own), one call at a time (a write's begin, then its commit).
    `ConnectionError`: the socket is gone or unreachable (another network namespace, the
    engine restarted or died): the caller goes by HTTP. `EngineError`: the engine refused,
    with its status."""

    def __init__(self, address: str, timeout_s: float = 600.0):
        if not isinstance(address, str) or not address.startswith("megatron-rl-weights-"):
            raise ValueError(f"shared-weights layout: control {str(address)[:100]!r} is not a "
                             "weight-write control address")
        self.address, self.timeout_s = address, timeout_s
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def call(self, body: dict[str, Any]) -> dict[str, Any]:
        where = f"weight-write control {body.get('op')}"
        try:
            reader, writer = await self._connected()
            writer.write(_line(body))
            line = await asyncio.wait_for(reader.readline(), self.timeout_s)
        except TimeoutError:
            await self.close()
            raise EngineError(f"{where}: no answer after {self.timeout_s:g}s",
                              endpoint="control") from None
        except (OSError, EOFError) as e:
            await self.close()
            raise ConnectionError(f"{where}: {type(e).__name__}: {e}") from e
        except ValueError:  # the reader's limit: a reply line over MAX_LINE
            await self.close()
            raise EngineError(f"{where}: the engine's answer is longer than {MAX_LINE} bytes",
                              endpoint="control") from None
        if not line:
            await self.close()
            raise ConnectionError(f"{where}: the engine closed the connection")
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            await self.close()
            raise EngineError(f"{where}: the engine answered {line[:200]!r}", endpoint="control")
        if "error" in reply:
            status = reply.get("status")
            raise EngineError(f"{where} was refused: {str(reply['error'])[:2000]}",
                              endpoint="control", status=status if isinstance(status, int)
                              else None, body=line.decode(errors="replace"))
        return reply

    async def _connected(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        loop = asyncio.get_running_loop()
        if self._streams is None or self._loop is not loop:
            self._streams = None  # another loop's streams cannot be used from this one
            self._streams = await asyncio.wait_for(
                asyncio.open_unix_connection("\0" + self.address, limit=MAX_LINE + 1), 10.0)
            self._loop = loop
        return self._streams

    async def close(self) -> None:
        if self._streams is not None and self._loop is asyncio.get_running_loop():
            self._streams[1].close()
            with contextlib.suppress(OSError):
                await self._streams[1].wait_closed()
        self._streams = None
