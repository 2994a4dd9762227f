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

    python -m megatron_rl.engines.embedded --model DIR --port 0   # prints the URL
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from megatron_rl.engines.embedded_core import (
    GENERATE_FIELDS,
    BadRequest,
    EmbeddedCore,
    Sampling,
    Seq,
    is_int,
    typed_field,
)
from megatron_rl.engines.tensors import (
    FLATTENED,
    SharedBucket,
    decode_safetensors,
    shm_header,
)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status},
                              "success": False, "message": message}, status=status)


async def _json_body(request: web.Request, required: bool = True) -> dict[str, Any]:
    if not request.can_read_body:
        if required:
            raise BadRequest("request body: expected a JSON object")
        return {}
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body: expected a JSON object, got {type(body).__name__}")
    return body


@web.middleware
async def _errors(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as e:
        return _error(str(e), e.status)
    except web.HTTPException:
        raise
    except Exception as e:  # a model or engine failure: say what it was, not just "500"
        log.exception("%s %s failed", request.method, request.path)
        return _error(f"{type(e).__name__}: {e}", 500)


class EmbeddedServer:
    """The embedded engine behind a real HTTP server (its own thread and event loop).

        with EmbeddedServer(model, tokenizer).start() as server:
            engine = HttpEngine(server.url)
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *,
                 host: str = "127.0.0.1", port: int = 0, model_path: str = "",
                 served_model_name: str = "default", weight_version: int = 0,
                 max_batch_size: int = 32, return_original_logprob: bool = False,
                 context_length: int | None = None):
        self.core = EmbeddedCore(model, tokenizer, weight_version=weight_version,
                                 max_batch_size=max_batch_size,
                                 return_original_logprob=return_original_logprob,
                                 context_length=context_length)
        self.tokenizer = tokenizer
        self.host, self.port = host, port
        self.model_path = model_path
        self.served_model_name = served_model_name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._startup_error: BaseException | None = None
        self._groups: dict[str, Any] = {}  # weight-update broadcast groups by name

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
        self.core.start()
        self._thread = threading.Thread(target=self._serve, name="embedded-http", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._startup_error is not None:
            raise RuntimeError(f"embedded server did not start: {self._startup_error}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.core.stop()

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Block until SIGINT/SIGTERM (the CLI)."""
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        while not done.wait(0.5) and self._thread.is_alive():
            pass
        self.stop()

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
        # weight updates carry whole tensors in JSON: lift aiohttp's 1 MiB body limit
        app = web.Application(middlewares=[_errors], client_max_size=1 << 40)
        self._routes(app)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.core.call(fn))

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
        r.add_post("/abort_request", self._abort)
        r.add_post("/pause_generation", self._pause)
        r.add_post("/continue_generation", self._continue)
        r.add_post("/update_weights_from_tensor", self._update_from_tensor)
        r.add_post("/update_weights_from_disk", self._update_from_disk)
        r.add_post("/update_weight_version", self._update_version)
        r.add_post("/init_weights_update_group", self._init_group)
        r.add_post("/update_weights_from_distributed", self._update_from_distributed)
        r.add_post("/destroy_weights_update_group", self._destroy_group)
        for path, fn in (("/release_memory_occupation", self._release),
                         ("/resume_memory_occupation", self._resume),
                         ("/flush_cache", self._flush)):
            r.add_get(path, fn)
            r.add_post(path, fn)
        r.add_post("/v1/chat/completions", self._chat)

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
        info = await self._call(self.core.info)
        return web.json_response({**info, "engine": "embedded", "model_path": self.model_path})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.served_model_name, "object": "model", "owned_by": "megatron-rl"}]})

    def _parse_generate(self, body: dict[str, Any]) -> Seq:
        unknown = sorted(set(body) - GENERATE_FIELDS)
        if unknown:
            raise BadRequest(f"{unknown[0]}: not supported by the embedded engine")
        if body.get("stream"):
            raise BadRequest("stream: streaming is not supported by the embedded engine")
        if body.get("logprob_start_len") not in (None, -1):
            raise BadRequest("logprob_start_len: only output-token log-probs are returned")
        if body.get("top_logprobs_num") not in (None, 0):
            raise BadRequest("top_logprobs_num: top log-probs are not supported")
        if body.get("routed_experts_start_len") not in (None, 0):
            raise BadRequest("routed_experts_start_len: only 0 is supported")
        rid = body.get("rid")
        if rid is None:
            rid = uuid.uuid4().hex
        if not isinstance(rid, str):
            raise BadRequest(f"rid: expected a string, got {rid!r}")
        ids = body.get("input_ids")
        if ids is None and body.get("text") is not None:
            if self.tokenizer is None:
                raise BadRequest("text: this server has no tokenizer; send input_ids")
            if not isinstance(body["text"], str):
                raise BadRequest("text: expected a string (batches are not supported)")
            ids = self.tokenizer.encode(body["text"], add_special_tokens=False)
        if ids is None:
            raise BadRequest("input_ids: required (a non-empty list of token ids)")
        if not (isinstance(ids, list) and ids and all(is_int(t) for t in ids)):
            raise BadRequest(f"input_ids: expected a non-empty list of token ids, got "
                             f"{str(ids)[:80]}")
        bad = [t for t in ids if not 0 <= t < self.core.vocab_size]
        if bad:
            raise BadRequest(f"input_ids: token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.core.vocab_size})")
        if len(ids) >= self.core.context_length:
            raise BadRequest(f"input_ids: {len(ids)} tokens exceed the context length "
                             f"{self.core.context_length}")
        routed = typed_field(body, "return_routed_experts", "bool", False, "")
        if routed and not self.core.routers:
            raise BadRequest("return_routed_experts: the model has no experts (or no router "
                             "transformers can record)")
        return Seq(rid=rid, prompt=list(ids),
                   sampling=Sampling.parse(body.get("sampling_params"), self.core.vocab_size),
                   return_logprob=bool(typed_field(body, "return_logprob", "bool", False, "")),
                   return_routed=routed, future=concurrent.futures.Future())

    async def _run(self, seq: Seq) -> dict[str, Any]:
        if self.core.released:
            raise BadRequest("memory is released: call /resume_memory_occupation first", 503)
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
        body = await _json_body(request)
        return web.json_response(await self._run(self._parse_generate(body)))

    async def _abort(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise BadRequest(f"rid: expected a string, got {rid!r}")
        abort_all = bool(body.get("abort_all", False))
        await self._call(lambda: self.core.abort(rid, abort_all=abort_all))
        return web.Response(status=200)

    async def _pause(self, request: web.Request) -> web.Response:
        body = await _json_body(request, required=False)
        mode = body.get("mode", "abort")  # SGLang's default mode
        await self._call(lambda: self.core.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        await self._call(self.core.resume)
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def _update_from_tensor(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
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
            if header is not None:  # same machine: copy straight from the trainer's segment
                with SharedBucket(header) as named:
                    await self._abort_all_if_asked(body)
                    await self._call(lambda: self.core.load_weights(named, version))
                return web.json_response({"success": True,
                                          "message": "Succeeded to update weights."})
            named = await asyncio.get_running_loop().run_in_executor(
                None, decode_safetensors, payloads[0])
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise BadRequest(f"serialized_named_tensors: {e}") from None
        await self._abort_all_if_asked(body)
        await self._call(lambda: self.core.load_weights(named, version))
        return web.json_response({"success": True, "message": "Succeeded to update weights."})

    async def _abort_all_if_asked(self, body: dict[str, Any]) -> None:
        if body.get("abort_all_requests"):
            await self._call(lambda: self.core.abort(None, abort_all=True,
                                                     message="Aborted for a weight update"))

    async def _update_from_disk(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        path = body.get("model_path")
        if not isinstance(path, str):
            raise BadRequest("model_path: required (a directory of safetensors files)")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format: {body['load_format']!r} is not supported")
        named = await asyncio.get_running_loop().run_in_executor(None, _read_safetensors_dir,
                                                                 Path(path))
        version = body.get("weight_version")
        await self._abort_all_if_asked(body)
        await self._call(lambda: self.core.load_weights(named, version, require_complete=True))
        self.model_path = path
        return web.json_response({"success": True, "message": "Succeeded to update weights.",
                                  "num_paused_requests": 0})

    async def _update_version(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if body.get("abort_all_requests", True):  # SGLang's default aborts all
            await self._call(lambda: self.core.abort(None, abort_all=True))
        await self._call(lambda: self.core.set_version(body.get("new_version")))
        return web.json_response({"success": True, "new_version": self.core.weight_version,
                                  "message": f"Weight version updated to "
                                             f"{self.core.weight_version}"})

    # The trainer's rank 0 and this server form a broadcast group of their own (the trainer at
    # rank 0, this server at `rank_offset`); on CPU it is gloo, as the trainer's side is.
    async def _init_group(self, request: web.Request) -> web.Response:
        import datetime

        import torch.distributed as dist

        body = await _json_body(request)
        host = typed_field(body, "master_address", "str", None, "")
        port = typed_field(body, "master_port", "int", None, "")
        rank = typed_field(body, "rank_offset", "int", None, "")
        world = typed_field(body, "world_size", "int", None, "")
        name = body.get("group_name", "weight_update_group")
        if body.get("backend", "gloo") != "gloo":
            raise BadRequest(f"backend: {body.get('backend')!r} needs a GPU; the embedded "
                             "engine joins gloo groups")
        if None in (host, port, rank, world) or not 0 < rank < world:
            raise BadRequest("master_address, master_port, rank_offset (1..world_size-1) and "
                             "world_size are required")
        timeout = datetime.timedelta(seconds=300)

        def join() -> Any:
            store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
            return dist.ProcessGroupGloo(store, rank, world, timeout)

        self._groups[name] = await asyncio.get_running_loop().run_in_executor(None, join)
        return web.json_response({"success": True, "message": "Succeeded to initialize group."})

    async def _update_from_distributed(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        name = body.get("group_name", "weight_update_group")
        group = self._groups.get(name)
        if group is None:
            raise BadRequest(f"group_name: no weight-update group {name!r}; call "
                             "/init_weights_update_group first")
        names, dtypes, shapes = (body.get(k) for k in ("names", "dtypes", "shapes"))
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes) and names):
            raise BadRequest("names, dtypes, shapes: non-empty lists of equal length")
        try:
            empty = [torch.empty(shape, dtype=getattr(torch, d))
                     for shape, d in zip(shapes, dtypes, strict=True)]
        except (AttributeError, TypeError, RuntimeError) as e:
            raise BadRequest(f"dtypes/shapes: {e}") from None

        def receive() -> None:
            for t in empty:
                group.broadcast(t, 0).wait()

        await asyncio.get_running_loop().run_in_executor(None, receive)
        version = body.get("weight_version")
        await self._abort_all_if_asked(body)
        named = list(zip(names, empty, strict=True))
        await self._call(lambda: self.core.load_weights(named, version))
        return web.json_response({"success": True, "message": "Succeeded to update weights."})

    async def _destroy_group(self, request: web.Request) -> web.Response:
        body = await _json_body(request, required=False)
        self._groups.pop(body.get("group_name", "weight_update_group"), None)
        return web.json_response({"success": True, "message": "Succeeded to destroy group."})

    async def _release(self, request: web.Request) -> web.Response:
        await self._call(self.core.release)
        return web.Response(status=200)

    async def _resume(self, request: web.Request) -> web.Response:
        await self._call(lambda: setattr(self.core, "released", False))
        return web.Response(status=200)

    async def _flush(self, request: web.Request) -> web.Response:
        # no prefix cache is kept between requests, so there is nothing to drop
        return web.Response(text="Cache flushed.\n", status=200)

    async def _chat(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
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
        enc = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
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
    p.add_argument("--return-original-logprob", action="store_true",
                   help="log-probs of the raw logits (SGLANG_RETURN_ORIGINAL_LOGPROB)")
    args = p.parse_args(argv)
    kw = dict(host=args.host, port=args.port, weight_version=args.weight_version,
              max_batch_size=args.max_batch_size,
              return_original_logprob=args.return_original_logprob)
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
