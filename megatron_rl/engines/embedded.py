"""The embedded engine: SGLang's HTTP surface served from a transformers model on CPU.

A real HTTP server on 127.0.0.1 so that `HttpEngine` drives it exactly as it drives SGLang:
`/generate`, `/abort_request`, `/pause_generation`, `/continue_generation`,
`/update_weights_from_tensor`, `/update_weights_from_disk`, `/update_weight_version`,
`/release_memory_occupation`, `/resume_memory_occupation`, `/flush_cache`, `/health`,
`/model_info`, `/server_info` and an OpenAI-compatible `/v1/chat/completions`.

One scheduler thread owns the model. Between decode steps it applies control calls (abort,
pause, weight updates), so a weight update lands between two tokens and every token records the
version that produced it. Requests are batched continuously: new ones are prefilled together
(left-padded) and their KV caches merged into the running batch; finished rows are dropped.

Semantics follow SGLang 0.5.23 (docs/engines.md lists the differences): log-probs are those of
the temperature-scaled distribution before top-k/top-p (raw logits when greedy, or always with
`return_original_logprob`, SGLang's SGLANG_RETURN_ORIGINAL_LOGPROB); output ids include the
matched stop token; an abort returns the partial output with finish_reason "abort".

Hostile input (docs/engines.md, "Hardening"): bodies are size-capped (413) and validated at
the boundary (400 naming the field); a failure in a batched step fails only the request that
fails alone; blocking control calls time out (504); SIGTERM stops the server in seconds. Off
loopback the control routes need `MEGATRON_RL_ENGINE_TOKEN` (401 without it), and the server
refuses to start without one.

    python -m megatron_rl.engines.embedded --model DIR --port 0   # prints the URL
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from megatron_rl.engines.base import (
    CONTROL_ROUTES,
    MIN_TOKEN_CHARS,
    TOKEN_ENV,
    EngineError,
    GenerateRequest,
    GenerateResult,
    engine_token,
    is_loopback_host,
)
from megatron_rl.engines.embedded_core import (
    BadRequest,
    EmbeddedCore,
    Seq,
    memory_tags,
    parse_generate,
    parse_json_object,
    show,
    typed_field,
)
from megatron_rl.engines.http_client import (
    HttpEngine,
    build_generate_body,
    parse_generate_response,
)
from megatron_rl.engines.tensors import (
    FLATTENED,
    SharedBucket,
    decode_safetensors,
    shm_header,
)
from megatron_rl.engines.write_control import WriteControlServer

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------


MiB = 1 << 20
DEFAULT_MAX_BODY = 8 * MiB            # /generate and every small control body
DEFAULT_MAX_WEIGHT_BODY = 8 << 30     # /update_weights_from_tensor carries tensors (base64)
WEIGHT_ROUTES = frozenset({"/update_weights_from_tensor", "/update_weights_from_distributed"})


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status},
                              "success": False, "message": message}, status=status)


async def _json_body(request: web.Request, limit: int, required: bool = True
                     ) -> dict[str, Any]:
    """The body as a JSON object, read up to `limit` bytes (413 beyond, 400 if not JSON)."""
    def too_large(n: int | str) -> BadRequest:
        return BadRequest(f"request body: {n} bytes exceed the {limit}-byte limit of "
                          f"{request.path}", 413)

    if request.content_length is not None and request.content_length > limit:
        raise too_large(request.content_length)
    raw = bytearray()
    while chunk := await request.content.read(1 << 20):  # chunked bodies have no length
        raw += chunk
        if len(raw) > limit:
            raise too_large(f"more than {limit}")
    if not raw:
        if required:
            raise BadRequest("request body: expected a JSON object")
        return {}
    return parse_json_object(bytes(raw))


def _group_name(body: dict[str, Any]) -> str:
    name = body.get("group_name", "weight_update_group")
    if not isinstance(name, str):
        raise BadRequest(f"group_name: expected a string, got {show(name)}")
    return name


def _answer_to(e: Exception, where: str) -> tuple[str, int]:
    """The message and HTTP status a route answers for `e`: a refusal as it says, a model or
    engine failure logged and named (not just "500"). Call it where `e` is handled."""
    if isinstance(e, BadRequest):
        return str(e), e.status
    log.exception("%s failed", where)
    return f"{type(e).__name__}: {e}", 500


@web.middleware
async def _errors(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as e:
        return _error(*_answer_to(e, f"{request.method} {request.path}"))


class InProcessEngine(HttpEngine):
    """The client of an embedded engine in this process: `generate` hands the request to the
    scheduler directly, the same body and answer as POST /generate without the HTTP round
    trip through the server's thread (a median 4.6 ms from a finished request to its caller
    here, at the head and tail of every rollout). Every other call goes over HTTP, as any
    engine's."""

    def __init__(self, server: EmbeddedServer, **kw: Any):
        super().__init__(server.url, **kw)
        self.server = server

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        where = f"POST {self.url}/generate (in process)"
        try:
            data = await self.server.generate_here(build_generate_body(req))
        except asyncio.CancelledError:  # as HttpEngine: the rid is free when this returns
            with contextlib.suppress(Exception):
                await asyncio.shield(self.abort(req.rid))
            raise
        except Exception as e:  # what the route would answer
            message, status = _answer_to(e, where)
            raise EngineError(f"{where} failed with HTTP {status}: {message}",
                              endpoint="/generate", status=status, body=message) from e
        return parse_generate_response(req, data, self.moe_layout)

    async def abort(self, rid: str) -> None:
        # a step's cut aborts its requests together: in one pass of the scheduler, not one
        # HTTP call after another (~0.8 ms each here)
        await self.server.abort_here(rid)


class EmbeddedServer:
    """The embedded engine behind a real HTTP server (its own thread and event loop).

        with EmbeddedServer(model, tokenizer).start() as server:
            engine = HttpEngine(server.url)
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *,
                 host: str = "127.0.0.1", port: int = 0, model_path: str = "",
                 served_model_name: str = "default", weight_version: int = 0,
                 max_batch_size: int = 32, return_original_logprob: bool = False,
                 context_length: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY,
                 max_weight_body_bytes: int = DEFAULT_MAX_WEIGHT_BODY,
                 control_timeout_s: float = 120.0, shutdown_timeout_s: float = 2.0,
                 threads: int | None = None, prefix_cache: bool = True,
                 fast_output_layer: bool = False):
        self.core = EmbeddedCore(model, tokenizer, weight_version=weight_version,
                                 max_batch_size=max_batch_size,
                                 return_original_logprob=return_original_logprob,
                                 context_length=context_length, threads=threads,
                                 prefix_cache=prefix_cache,
                                 fast_output_layer=fast_output_layer)
        self.tokenizer = tokenizer
        self.host, self.port = host, port
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.max_body_bytes = max_body_bytes
        self.max_weight_body_bytes = max_weight_body_bytes
        # every blocking control call: group joins, broadcasts, disk reads, scheduler calls
        self.control_timeout_s = control_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s  # for in-flight handlers at stop
        self._token: bytes | None = None  # from the environment at start(), never logged
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._startup_error: BaseException | None = None
        self._groups: dict[str, Any] = {}  # weight-update broadcast groups by name
        self._waiting: set[asyncio.Future] = set()  # handlers waiting on _in_thread work
        self._stopping = False
        self._claiming = threading.Lock()  # rids are claimed from the server's loop and ours
        self._write_control: WriteControlServer | None = None  # once weights are shared

    @classmethod
    def from_pretrained(cls, path: str | Path, **kw: Any) -> EmbeddedServer:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError):
            tok = None  # a weights-only directory: token-id requests still work
        return cls(model, tok, model_path=str(path), **kw)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> EmbeddedServer:
        token = engine_token()
        if token is None and not is_loopback_host(self.host):
            raise RuntimeError(f"embedded server: refusing to bind {self.host} (not loopback) "
                               f"with an open control plane: set {TOKEN_ENV} (e.g. python -c "
                               "'import secrets; print(secrets.token_urlsafe(32))')")
        if token is not None and len(token) < MIN_TOKEN_CHARS:
            raise RuntimeError(f"embedded server: {TOKEN_ENV} is shorter than "
                               f"{MIN_TOKEN_CHARS} characters")
        self._token = None if token is None else token.encode()
        self.core.start()
        self._thread = threading.Thread(target=self._serve, name="embedded-http", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._startup_error is not None:
            raise RuntimeError(f"embedded server did not start: {self._startup_error}")
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop serving (in-flight handlers get `shutdown_timeout_s`), then the scheduler."""
        deadline = time.monotonic() + timeout_s
        if self._loop is not None and self._stop is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop already closed
                pass
        if self._thread is not None:
            self._thread.join(timeout=max(deadline - time.monotonic(), 0.1))
        if self._write_control is not None:
            self._write_control.close()
        self.core.stop(timeout_s=max(deadline - time.monotonic(), 0.1))

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self, stop_timeout_s: float = 5.0) -> None:
        """Block until SIGINT/SIGTERM (the CLI); then stop within about `stop_timeout_s`
        (blocked control calls run on daemon threads, which do not hold up the exit)."""
        done = threading.Event()
        signalled: list[float] = []

        def on_signal(*_: object) -> None:
            signalled.append(time.monotonic())
            done.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        while not done.wait(0.5) and self._thread.is_alive():
            pass
        self.stop(timeout_s=stop_timeout_s)
        if signalled:  # what the server itself took, apart from the interpreter's exit
            print(f"embedded server: stopped {time.monotonic() - signalled[0]:.2f}s after the "
                  "signal", file=sys.stderr, flush=True)

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as e:
            self._startup_error = e
            self._ready.set()
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        # bodies are read by _json_body with a per-route limit; this caps anything else
        app = web.Application(middlewares=[_errors], client_max_size=self.max_body_bytes)
        self._routes(app)
        # aiohttp waits this long twice (for handlers to finish, then after cancelling them)
        runner = web.AppRunner(app, access_log=None,
                               shutdown_timeout=self.shutdown_timeout_s / 2)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        self._ready.set()
        await self._stop.wait()
        # a handler waiting on a blocked thread answers now, instead of holding up the cleanup
        self._stopping = True
        for fut in list(self._waiting):
            if not fut.done():
                fut.set_exception(BadRequest("the server is stopping", 503))
        await runner.cleanup()

    def _timed_out(self, what: str, timeout_s: float) -> BadRequest:
        return BadRequest(f"{what}: no answer after {timeout_s:g}s (the server's control "
                          "timeout, --control-timeout-s)", 504)

    async def _call(self, fn: Callable[[], Any], what: str, finish_started: bool = False) -> Any:
        """Run `fn` on the scheduler thread between two steps; 504 after the control timeout
        (a scheduler stuck in a step must not hang the route). A call the scheduler has not
        started by then is dropped, never run late; one it has started runs on (its outcome
        is dropped), unless `finish_started`: then the route waits for it (`fn` reads memory
        the route frees when it returns)."""
        cfut = self.core.call(fn)
        done = asyncio.wrap_future(cfut)
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "unretrieved"
        try:
            return await asyncio.wait_for(asyncio.shield(done), self.control_timeout_s)
        except TimeoutError:
            if cfut.cancel() or not finish_started:
                raise self._timed_out(what, self.control_timeout_s) from None
        except asyncio.CancelledError:  # the handler is cancelled (server shutdown)
            if not cfut.cancel() and finish_started:
                await done
            raise
        return await done

    async def _in_thread(self, fn: Callable[[], Any], what: str,
                         timeout_s: float | None = None) -> Any:
        """Run blocking `fn` on a daemon thread (not the loop's executor, whose threads the
        interpreter joins at exit: a hung join would outlive SIGTERM); 504 after timeout_s
        (default: the control timeout; a hung filesystem or decode must not block forever)."""
        timeout_s = self.control_timeout_s if timeout_s is None else timeout_s
        if self._stopping:
            raise BadRequest("the server is stopping", 503)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not fut.done():
                (fut.set_result if ok else fut.set_exception)(value)

        def target() -> None:
            try:
                result: tuple[bool, Any] = (True, fn())
            except BaseException as e:
                result = (False, e)
            try:
                loop.call_soon_threadsafe(settle, *result)
            except RuntimeError:  # the server stopped meanwhile
                pass

        threading.Thread(target=target, name=f"embedded-{what}", daemon=True).start()
        self._waiting.add(fut)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise self._timed_out(what, timeout_s) from None
        finally:
            self._waiting.discard(fut)

    def _body(self, request: web.Request, required: bool = True
              ) -> Awaitable[dict[str, Any]]:
        limit = (self.max_weight_body_bytes if request.path in WEIGHT_ROUTES
                 else self.max_body_bytes)
        return _json_body(request, limit, required)

    def _authorized(self, request: web.Request) -> bool:
        if self._token is None:
            return True
        given = request.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        # constant-time: the comparison must not tell how much of a guess was right
        return hmac.compare_digest(value.strip().encode("utf-8", "replace"), self._token) \
            and scheme.lower() == "bearer"

    def _control(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                 ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def guarded(request: web.Request) -> web.StreamResponse:
            if not self._authorized(request):
                resp = _error(f"{request.path} is a control route: send the engine token "
                              f"(Authorization: Bearer ${TOKEN_ENV})", 401)
                resp.headers["WWW-Authenticate"] = "Bearer"
                return resp
            return await handler(request)
        return guarded

    # -- routes --------------------------------------------------------------------------------

    def _routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/health", self._health)
        r.add_get("/health_generate", self._health)
        r.add_get("/model_info", self._model_info)
        r.add_get("/server_info", self._server_info)
        r.add_get("/v1/models", self._models)
        r.add_route("POST", "/generate", self._generate)
        r.add_route("PUT", "/generate", self._generate)
        r.add_post("/v1/chat/completions", self._chat)
        control = {
            "/abort_request": self._abort, "/pause_generation": self._pause,
            "/continue_generation": self._continue,
            "/update_weights_from_tensor": self._update_from_tensor,
            "/update_weights_from_disk": self._update_from_disk,
            "/update_weight_version": self._update_version,
            "/init_weights_update_group": self._init_group,
            "/update_weights_from_distributed": self._update_from_distributed,
            "/destroy_weights_update_group": self._destroy_group,
            "/release_memory_occupation": self._release,
            "/resume_memory_occupation": self._resume, "/flush_cache": self._flush,
            "/shared_weights": self._shared_weights,
            "/shared_weights/begin": self._shared_begin,
            "/shared_weights/commit": self._shared_commit}
        assert set(control) == CONTROL_ROUTES  # the client sends the token to the same set
        get_too = {"/release_memory_occupation", "/resume_memory_occupation", "/flush_cache"}
        for path, fn in control.items():
            r.add_post(path, self._control(fn))
            if path in get_too:
                r.add_get(path, self._control(fn))

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.core.alive else 503)

    async def _model_info(self, request: web.Request) -> web.Response:
        cfg = self.core.model.config
        return web.json_response({
            "model_path": self.model_path, "served_model_name": self.served_model_name,
            "is_generation": True, "weight_version": self.core.weight_version,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None)})

    async def _server_info(self, request: web.Request) -> web.Response:
        info = await self._call(self.core.info, "server_info")
        return web.json_response({**info, "engine": "embedded", "model_path": self.model_path})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.served_model_name, "object": "model", "owned_by": "megatron-rl"}]})

    def _parse_generate(self, body: dict[str, Any]) -> Seq:
        return parse_generate(body, vocab_size=self.core.vocab_size,
                              context_length=self.core.context_length, tokenizer=self.tokenizer,
                              has_routers=bool(self.core.routers))

    async def _run(self, seq: Seq) -> dict[str, Any]:
        if self.core.released:
            raise BadRequest("memory is released: call /resume_memory_occupation first", 503)
        with self._claiming:
            if seq.rid in self.core.rids:
                raise BadRequest(f"rid: a request with rid '{seq.rid}' is already in flight")
            self.core.rids.add(seq.rid)
        self.core.submit(seq)
        try:
            return await asyncio.wrap_future(seq.future)
        except asyncio.CancelledError:
            # the client went away (or HttpEngine's call was cancelled): stop decoding for it
            self.core.call(lambda: self.core.abort(seq.rid))
            raise

    async def _generate(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        return web.json_response(await self._run(self._parse_generate(body)))

    async def abort_here(self, rid: str) -> None:
        """POST /abort_request for `rid`, without HTTP (`InProcessEngine`)."""
        await self._call(lambda: self.core.abort(rid), "abort_request")

    async def generate_here(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /generate's answer to `body` without HTTP, awaited in the caller's loop (a
        client in this process: `InProcessEngine`). Raises BadRequest as the route answers
        4xx."""
        return await self._run(self._parse_generate(body))

    async def _abort(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise BadRequest(f"rid: expected a string, got {show(rid)}")
        abort_all = bool(typed_field(body, "abort_all", "bool", False, ""))
        await self._call(lambda: self.core.abort(rid, abort_all=abort_all), "abort_request")
        return web.Response(status=200)

    async def _pause(self, request: web.Request) -> web.Response:
        body = await self._body(request, required=False)
        mode = body.get("mode", "abort")  # SGLang's default mode
        await self._call(lambda: self.core.pause(mode), "pause_generation")
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        await self._call(self.core.resume, "continue_generation")
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def _update_from_tensor(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        payloads = body.get("serialized_named_tensors")
        if not (isinstance(payloads, list) and payloads
                and all(isinstance(p, str) for p in payloads)):
            raise BadRequest("serialized_named_tensors: expected a non-empty list of base64 "
                             "strings (one per TP rank)")
        fmt = body.get("load_format")
        if fmt not in (None, FLATTENED):
            raise BadRequest(f"load_format: {fmt!r} is not supported (None or '{FLATTENED}')")
        version = body.get("weight_version")
        try:
            # the server is TP 1: every entry is the same tensors, so decode the first only
            header = shm_header(payloads[0])
            # the update's last bucket sets the version: earlier ones leave the segment
            # mapped for the next
            bucket = None if header is None else SharedBucket(header, keep=version is None)
            if header is None:
                named = await self._in_thread(lambda: decode_safetensors(payloads[0]),
                                              "serialized_named_tensors")
        except BadRequest:
            raise
        except Exception as e:  # whatever the payload breaks in decoding is the payload's fault
            raise BadRequest(f"serialized_named_tensors: {type(e).__name__}: {e}") from None
        if bucket is not None:  # same machine: copy straight from the trainer's segment
            with bucket as named:
                await self._abort_all_if_asked(body)
                await self._call(lambda: self.core.load_weights(named, version),
                                 "update_weights_from_tensor", finish_started=True)
            return web.json_response({"success": True,
                                      "message": "Succeeded to update weights."})
        await self._abort_all_if_asked(body)
        await self._call(lambda: self.core.load_weights(named, version),
                         "update_weights_from_tensor")
        return web.json_response({"success": True, "message": "Succeeded to update weights."})

    # One-copy sync from a trainer on this machine (engines/shared_weights.py): the layout of
    # the parameters in shared memory, then begin (hold every step) → the trainer writes →
    # commit (new version, decoding goes on).
    async def _shared_weights(self, request: web.Request) -> web.Response:
        layout = await self._call(self.core.share_weights, "shared_weights")
        if self._write_control is None:  # begin / commit without HTTP (write_control.py)
            try:
                self._write_control = WriteControlServer(
                    lambda: self._call_from_thread(self.core.begin_weight_write,
                                                   "shared_weights/begin"),
                    lambda version: self._call_from_thread(lambda: self._commit(version),
                                                           "shared_weights/commit"))
            except OSError as e:  # no Unix sockets here: the writers go by HTTP
                log.warning("weight-write control socket unavailable (%s): begin and commit "
                            "go over HTTP", e)
                return web.json_response(layout)
        return web.json_response({**layout, "control": self._write_control.address})

    def _commit(self, version: Any) -> str:
        self.core.commit_weight_write(version)
        return self.core.weight_version

    def _call_from_thread(self, fn: Callable[[], Any], what: str) -> Any:
        """`_call` for a thread of its own (the write control's): `fn` on the scheduler
        thread, 504 after the control timeout."""
        cfut = self.core.call(fn)
        try:
            return cfut.result(self.control_timeout_s)
        except TimeoutError:
            cfut.cancel()
            raise self._timed_out(what, self.control_timeout_s) from None

    async def _shared_begin(self, request: web.Request) -> web.Response:
        segment = await self._call(self.core.begin_weight_write, "shared_weights/begin")
        return web.json_response({"success": True, "segment": segment})

    async def _shared_commit(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        version = body.get("weight_version")
        await self._call(lambda: self.core.commit_weight_write(version), "shared_weights/commit")
        return web.json_response({"success": True, "weight_version": self.core.weight_version})

    async def _abort_all_if_asked(self, body: dict[str, Any]) -> None:
        if body.get("abort_all_requests"):
            await self._call(lambda: self.core.abort(None, abort_all=True,
                                                     message="Aborted for a weight update"),
                             "abort_all_requests")

    async def _update_from_disk(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        path = body.get("model_path")
        if not isinstance(path, str):
            raise BadRequest("model_path: required (a directory of safetensors files)")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format: {body['load_format']!r} is not supported")
        try:
            named = await self._in_thread(lambda: _read_safetensors_dir(Path(path)),
                                          "model_path")
        except BadRequest:
            raise
        except Exception as e:  # unreadable or corrupt files
            raise BadRequest(f"model_path: {type(e).__name__}: {str(e)[:300]}") from None
        version = body.get("weight_version")
        await self._abort_all_if_asked(body)
        await self._call(lambda: self.core.load_weights(named, version, require_complete=True),
                         "update_weights_from_disk")
        self.model_path = path
        return web.json_response({"success": True, "message": "Succeeded to update weights.",
                                  "num_paused_requests": 0})

    async def _update_version(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body.get("abort_all_requests", True):  # SGLang's default aborts all
            await self._call(lambda: self.core.abort(None, abort_all=True), "update_weight_version")
        await self._call(lambda: self.core.set_version(body.get("new_version")),
                         "update_weight_version")
        return web.json_response({"success": True, "new_version": self.core.weight_version,
                                  "message": f"Weight version updated to "
                                             f"{self.core.weight_version}"})

    # The trainer's rank 0 and this server form a broadcast group of their own (the trainer at
    # rank 0, this server at `rank_offset`); on CPU it is gloo, as the trainer's side is.
    # Joining and receiving block on the trainer: both time out after control_timeout_s.
    async def _init_group(self, request: web.Request) -> web.Response:
        import datetime

        import torch.distributed as dist

        body = await self._body(request)
        host = typed_field(body, "master_address", "str", None, "")
        port = typed_field(body, "master_port", "int", None, "")
        rank = typed_field(body, "rank_offset", "int", None, "")
        world = typed_field(body, "world_size", "int", None, "")
        name = _group_name(body)
        if body.get("backend", "gloo") != "gloo":
            raise BadRequest(f"backend: {show(body.get('backend'))} needs a GPU; the embedded "
                             "engine joins gloo groups")
        if None in (host, port, rank, world) or not 0 < rank < world:
            raise BadRequest("master_address, master_port, rank_offset (1..world_size-1) and "
                             "world_size are required")
        if not 0 < len(host) <= 255:
            raise BadRequest(f"master_address: expected a host name or IP, got {show(host)}")
        if not 0 < port < 65536:
            raise BadRequest(f"master_port: must be in [1, 65535], got {show(port)}")
        if world > 1 << 16:
            raise BadRequest(f"world_size: at most {1 << 16}, got {show(world)}")
        timeout = datetime.timedelta(seconds=self.control_timeout_s)

        def join() -> Any:
            store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
            return dist.ProcessGroupGloo(store, rank, world, timeout)

        try:
            group = await self._in_thread(join, "init_weights_update_group",
                                          self.control_timeout_s)
        except RuntimeError as e:  # DistNetworkError / DistStoreError: the trainer is not there
            raise BadRequest(f"init_weights_update_group: cannot join the group at "
                             f"{host}:{port}: {str(e).splitlines()[0][:300]}", 502) from None
        self._groups[name] = group
        return web.json_response({"success": True, "message": "Succeeded to initialize group."})

    async def _update_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        name = _group_name(body)
        group = self._groups.get(name)
        if group is None:
            raise BadRequest(f"group_name: no weight-update group {name!r}; call "
                             "/init_weights_update_group first")
        names, dtypes, shapes = (body.get(k) for k in ("names", "dtypes", "shapes"))
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes) and names):
            raise BadRequest("names, dtypes, shapes: non-empty lists of equal length")
        if not all(isinstance(n, str) for n in names):
            raise BadRequest("names: expected tensor names (strings)")
        kinds = [getattr(torch, d, None) if isinstance(d, str) else None for d in dtypes]
        bad = [d for d, k in zip(dtypes, kinds) if not isinstance(k, torch.dtype)]
        if bad:
            raise BadRequest(f"dtypes: {show(bad[0])} is not a torch dtype")
        try:
            # shapes against the model's before a byte is allocated (meta tensors are free)
            meta = [torch.empty(shape, dtype=k, device="meta") for shape, k in zip(shapes, kinds)]
        except (TypeError, RuntimeError, ValueError, OverflowError) as e:
            raise BadRequest(f"shapes: {str(e)[:200]}") from None
        self.core.weights.validate(list(zip(names, meta, strict=True)))
        empty = [torch.empty(t.shape, dtype=t.dtype) for t in meta]

        def receive() -> None:
            for t in empty:
                group.broadcast(t, 0).wait()

        try:
            await self._in_thread(receive, "update_weights_from_distributed",
                                  self.control_timeout_s)
        except BadRequest:
            self._groups.pop(name, None)  # a broadcast left half-received: the group is spent
            raise
        except RuntimeError as e:
            self._groups.pop(name, None)
            raise BadRequest(f"update_weights_from_distributed: broadcast failed: "
                             f"{str(e).splitlines()[0][:300]}", 502) from None
        version = body.get("weight_version")
        await self._abort_all_if_asked(body)
        named = list(zip(names, empty, strict=True))
        await self._call(lambda: self.core.load_weights(named, version),
                         "update_weights_from_distributed")
        return web.json_response({"success": True, "message": "Succeeded to update weights."})

    async def _destroy_group(self, request: web.Request) -> web.Response:
        body = await self._body(request, required=False)
        self._groups.pop(_group_name(body), None)
        return web.json_response({"success": True, "message": "Succeeded to destroy group."})

    async def _release(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        await self._call(lambda: self.core.release(tags), "release_memory_occupation")
        return web.Response(status=200)

    async def _resume(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        await self._call(lambda: self.core.resume_memory(tags), "resume_memory_occupation")
        return web.Response(status=200)

    async def _tags(self, request: web.Request) -> list[str] | None:
        """SGLang's `tags` (ReleaseMemoryOccupationReqInput): None = every memory region."""
        if request.method == "GET":
            return None
        body = await self._body(request, required=False)
        tags = body.get("tags")
        memory_tags(tags)  # checked here: a bad list is a 400 before the engine is touched
        return tags

    async def _flush(self, request: web.Request) -> web.Response:
        await self._call(self.core.flush_cache, "flush_cache")
        return web.Response(text="Cache flushed.\n", status=200)

    async def _chat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if self.tokenizer is None:
            raise BadRequest("this server has no tokenizer: /v1/chat/completions needs one")
        msgs = body.get("messages")
        if not (isinstance(msgs, list) and msgs and all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs)):
            raise BadRequest("messages: expected a non-empty list of {role, content} objects")
        if body.get("stream"):
            raise BadRequest("stream: streaming is not supported by the embedded engine")
        if body.get("n", 1) != 1:
            raise BadRequest("n: only n=1 is supported")
        try:
            enc = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                     tokenize=True)
        except Exception as e:  # the template's own complaint (a missing role, ...)
            raise BadRequest(f"messages: the chat template failed: {type(e).__name__}: "
                             f"{str(e)[:200]}") from None
        ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) or 128
        sp: dict[str, Any] = {"max_new_tokens": max_tokens,
                              "temperature": body.get("temperature", 1.0),
                              "top_p": body.get("top_p", 1.0)}
        if body.get("seed") is not None:
            sp["sampling_seed"] = body["seed"]
        seq = self._parse_generate({"input_ids": ids, "sampling_params": sp,
                                    "rid": f"chatcmpl-{uuid.uuid4().hex}"})
        out = await self._run(seq)
        meta = out["meta_info"]
        kind = meta["finish_reason"]["type"]
        return web.json_response({
            "id": seq.rid, "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or self.served_model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out["text"]},
                         "finish_reason": "stop" if kind == "stop" else kind}],
            "usage": {"prompt_tokens": meta["prompt_tokens"],
                      "completion_tokens": meta["completion_tokens"],
                      "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"]}})


def _read_safetensors_dir(path: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise BadRequest(f"model_path: no *.safetensors files in {path}")
    named: list[tuple[str, torch.Tensor]] = []
    for f in files:
        named.extend(load_file(f).items())
    return named


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Serve a HF causal LM on CPU behind SGLang's HTTP API")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF model directory (config + safetensors [+ tokenizer])")
    src.add_argument("--random-init", metavar="NAME",
                     help="a registry model (configs/models/NAME.yaml) with random weights")
    p.add_argument("--seed", type=int, default=0, help="init seed for --random-init")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads of the generation loop (0: torch's default)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="run every prompt in full (no prefixes kept between requests)")
    p.add_argument("--fast-output-layer", action="store_true",
                   help="logits from a transposed copy of the output weight (faster at few "
                   "rows; not bit for bit F.linear's: engines/output_layer.py)")
    p.add_argument("--return-original-logprob", action="store_true",
                   help="log-probs of the raw logits (SGLANG_RETURN_ORIGINAL_LOGPROB)")
    p.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY / MiB,
                   help="body limit of /generate and the small control routes (413 beyond)")
    p.add_argument("--max-weight-body-mb", type=float, default=DEFAULT_MAX_WEIGHT_BODY / MiB,
                   help="body limit of /update_weights_from_tensor[/_distributed]")
    p.add_argument("--control-timeout-s", type=float, default=120.0,
                   help="how long a control call may block: a group join, a weight broadcast "
                        "or disk read, a call into the scheduler (504 after)")
    args = p.parse_args(argv)
    from megatron_rl.utils.host_memory import tune_host_memory

    tune_host_memory()
    if engine_token() is None and not is_loopback_host(args.host):
        p.error(f"--host {args.host} is not loopback: set {TOKEN_ENV} in the environment")
    kw = dict(host=args.host, port=args.port, weight_version=args.weight_version,
              max_batch_size=args.max_batch_size,
              return_original_logprob=args.return_original_logprob,
              max_body_bytes=int(args.max_body_mb * MiB),
              max_weight_body_bytes=int(args.max_weight_body_mb * MiB),
              control_timeout_s=args.control_timeout_s, threads=args.threads or None,
              prefix_cache=not args.no_prefix_cache,
              fast_output_layer=args.fast_output_layer)
    if args.model:
        server = EmbeddedServer.from_pretrained(args.model, **kw)
    else:
        from transformers import AutoModelForCausalLM

        from megatron_rl.models.registry import get_model_spec

        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(get_model_spec(args.random_init).hf_config())
        server = EmbeddedServer(model.float(), model_path=f"random-init:{args.random_init}", **kw)
    server.start()
    print(server.url, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
