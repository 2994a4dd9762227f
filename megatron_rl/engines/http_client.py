"""`HttpEngine`: the one client for SGLang's HTTP API (SGLang servers and the embedded server).

Request bodies follow SGLang 0.5.23's `io_struct` request structs field for field (pinned by
tests/test_sglang_contract.py against the released source). Two SGLang facts shape the code:
weight versions are strings on the wire (`weight_version: Optional[str]`), so the integer
versions of the protocol are sent as `str(v)`; and `meta_info.weight_versions` gives
`{version, start, end}` spans over the output tokens when the version changed mid-request,
which `parse_generate_response` expands to one version per token.

Control calls (`base.CONTROL_ROUTES`) carry `Authorization: Bearer $MEGATRON_RL_ENGINE_TOKEN`
when that variable is set (an engine off loopback requires it); the token is read from the
environment only and is never part of a message.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import Iterable
from typing import Any, Literal

import aiohttp
import numpy as np
import torch

from megatron_rl.engines.base import (
    CONTROL_ROUTES,
    EngineError,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    engine_token,
)
from megatron_rl.engines.tensors import (
    FLATTENED,
    ShmWriter,
    buckets_with_last,
    dtype_name,
    encode_safetensors,
    encode_torch_ipc,
)
from megatron_rl.engines.write_control import WriteControlClient
from megatron_rl.utils.http import SessionHolder

TensorTransport = Literal["safetensors", "torch_ipc", "shm"]
DEFAULT_GROUP = "weight_update_group"


def build_generate_body(req: GenerateRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "rid": req.rid,
        "input_ids": list(req.input_ids),
        "sampling_params": req.sampling.to_sglang(),
        "return_logprob": req.return_logprob,
    }
    if req.return_routed_experts:
        body["return_routed_experts"] = True
    return body


def parse_version(v: Any, where: str) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        raise EngineError(f"{where}: weight_version {v!r} is not an integer (launch SGLang with "
                          "--weight-version 0 and update with integer versions)",
                          endpoint=where) from None


def expand_weight_versions(meta: dict[str, Any], n_out: int) -> list[int]:
    """One version per output token, from SGLang's spans (or the single current version)."""
    spans = meta.get("weight_versions") or []
    if not spans:
        v = meta.get("weight_version")
        return [] if v is None else [parse_version(v, "/generate")] * n_out
    out: list[int] = []
    for span in spans:
        v = parse_version(span["version"], "/generate")
        out.extend([v] * (int(span["end"]) - int(span["start"])))
    if len(out) != n_out:
        raise EngineError(f"/generate: weight_versions spans cover {len(out)} tokens, output has "
                          f"{n_out}", endpoint="/generate")
    return out


def parse_generate_response(req: GenerateRequest, data: dict[str, Any],
                            moe_layout: tuple[int, int] | None = None) -> GenerateResult:
    meta = data.get("meta_info") or {}
    triples = meta.get("output_token_logprobs") or []
    output_ids = data.get("output_ids")
    if output_ids is None:  # servers that omit output_ids still send ids in the logprob triples
        output_ids = [int(t[1]) for t in triples]
    output_ids = [int(t) for t in output_ids]
    logprobs: list[float] = []
    if req.return_logprob:
        if len(triples) != len(output_ids) or any(int(t[1]) != i
                                                  for t, i in zip(triples, output_ids)):
            raise EngineError(f"/generate rid={req.rid}: output_token_logprobs do not match "
                              "output_ids", endpoint="/generate")
        logprobs = [float(t[0]) for t in triples]
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind not in ("stop", "length", "abort"):
        raise EngineError(f"/generate rid={req.rid}: unexpected finish_reason {fr!r}",
                          endpoint="/generate")
    routed = None
    if meta.get("routed_experts") is not None:
        routed = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        if routed.size == 0:  # nothing was fed (aborted before it started)
            routed = routed.reshape(0, *(moe_layout or (0,)))
        else:
            rows = len(req.input_ids) + len(output_ids) - 1
            routed = routed.reshape(rows, *(moe_layout or (-1,)))
    return GenerateResult(
        rid=req.rid, output_ids=output_ids, output_logprobs=logprobs, finish_reason=kind,
        weight_versions=expand_weight_versions(meta, len(output_ids)), routed_experts=routed,
        prompt_tokens=int(meta.get("prompt_tokens", len(req.input_ids))),
        text=data.get("text", "") or "", meta_info=meta)


class HttpEngine:
    """Async client for one server (or router) URL.

    `tensor_transport` picks the `/update_weights_from_tensor` payload: "torch_ipc" is SGLang's
    own (tensor handles; colocated only), "safetensors" sends values (the embedded engine),
    "shm" a shared-memory segment (the embedded engine on the same machine; no copy over HTTP).
    `num_tp_payloads` is the number of serialized copies SGLang expects (its TP size).
    `moe_layout=(num_layers, top_k)` shapes returned routed experts.
    """

    def __init__(self, url: str, *, timeout_s: float = 600.0, connect_timeout_s: float = 10.0,
                 tensor_transport: TensorTransport = "safetensors", num_tp_payloads: int = 1,
                 bucket_bytes: int = 256 << 20, flattened: bool = True,
                 moe_layout: tuple[int, int] | None = None, weight_version: int = 0,
                 use_write_control: bool = True):
        if tensor_transport not in ("safetensors", "torch_ipc", "shm"):
            raise ValueError(f"tensor_transport={tensor_transport!r}: 'safetensors', "
                             "'torch_ipc' or 'shm'")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.tensor_transport = tensor_transport
        self.num_tp_payloads = num_tp_payloads
        self.bucket_bytes = bucket_bytes
        self.flattened = flattened
        self.moe_layout = moe_layout
        self._weight_version = weight_version
        self._http = SessionHolder(f"HttpEngine({self.url})")  # one session for the run
        self._shm: ShmWriter | None = None
        # False: a one-copy write's begin and commit go over HTTP even where the engine
        # offers its socket (benchmarks/weight_sync.py's reference)
        self.use_write_control = use_write_control
        self._write_control: WriteControlClient | None = None  # from the shared layout
        token = engine_token()
        self._auth = None if token is None else {"Authorization": f"Bearer {token}"}

    # -- plumbing ------------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    async def close(self) -> None:
        """Close the HTTP session (and shm segment); a later call, in any loop, reopens."""
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._write_control is not None:
            await self._write_control.close()
        await self._http.close()

    async def __aenter__(self) -> HttpEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request(self, method: str, endpoint: str, body: dict[str, Any] | None = None,
                      *, timeout_s: float | None = None) -> Any:
        """One call; returns parsed JSON (or text). Raises EngineError on any failure."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s,
                                        sock_connect=self.connect_timeout_s)
        where = f"{method} {self.url}{endpoint}"
        headers = self._auth if endpoint.split("?")[0] in CONTROL_ROUTES else None
        try:
            async with self._http.get().request(method, self.url + endpoint, json=body,
                                                timeout=timeout, headers=headers) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise EngineError(f"{where} failed with HTTP {resp.status}: {text[:2000]}",
                                      endpoint=endpoint, status=resp.status, body=text)
                data: Any = text
                if resp.content_type == "application/json" and text:
                    data = await resp.json()
        except TimeoutError:
            raise EngineError(f"{where} timed out after {timeout.total:g}s",
                              endpoint=endpoint) from None
        except aiohttp.ClientError as e:
            raise EngineError(f"{where} failed: {type(e).__name__}: {e}",
                              endpoint=endpoint) from e
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(f"{where} was refused: {data.get('message', data)}",
                              endpoint=endpoint, status=200, body=text)
        return data

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        try:
            data = await self.request("POST", "/generate", build_generate_body(req))
        except asyncio.CancelledError:
            # a server keeps generating for a dropped connection: abort the request, so its
            # compute stops and its rid is free for the session that resumes it
            with contextlib.suppress(Exception):
                await asyncio.shield(self.abort(req.rid))
            raise
        if not isinstance(data, dict):
            raise EngineError(f"POST {self.url}/generate returned {data!r}", endpoint="/generate")
        return parse_generate_response(req, data, self.moe_layout)

    async def abort(self, rid: str) -> None:
        await self.request("POST", "/abort_request", {"rid": rid})

    async def pause_generation(self, mode: PauseMode = "retract") -> None:
        await self.request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self.request("POST", "/continue_generation", {})

    async def chat(self, messages: list[dict[str, str]], *, max_tokens: int = 256,
                   temperature: float = 0.0, seed: int | None = None) -> str:
        """OpenAI-compatible chat (judge / summarizer use): the assistant's text."""
        body: dict[str, Any] = {"model": "default", "messages": messages,
                                "max_tokens": max_tokens, "temperature": temperature}
        if seed is not None:
            body["seed"] = seed
        data = await self.request("POST", "/v1/chat/completions", body)
        return data["choices"][0]["message"]["content"]

    # -- weights -------------------------------------------------------------------------------

    def _serialize(self, bucket: list[tuple[str, torch.Tensor]]) -> list[str]:
        if self.tensor_transport == "torch_ipc":
            # one pickle per TP rank: each rank drops its own IPC references after loading
            return [encode_torch_ipc(bucket, self.flattened) for _ in range(self.num_tp_payloads)]
        return [encode_safetensors(bucket, self.flattened)] * self.num_tp_payloads

    async def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                                          weight_version: int | None) -> None:
        """Send HF-named tensors in buckets; the version is set with the last bucket only, so
        tokens generated between buckets keep the old version (None: leave it; a caller that
        buckets itself sets it with its last call). `named_tensors` is consumed lazily (e.g. a
        generator gathering from the trainer): at most two buckets are held."""

        async def send(bucket: list[tuple[str, torch.Tensor]], last: bool) -> None:
            if self.tensor_transport == "shm":
                self._shm = self._shm or ShmWriter()
                payloads = [self._shm.write(bucket)] * self.num_tp_payloads
            else:
                payloads = self._serialize(bucket)
            body: dict[str, Any] = {"serialized_named_tensors": payloads,
                                    "flush_cache": last, "abort_all_requests": False}
            if self.flattened:
                body["load_format"] = FLATTENED
            if last and weight_version is not None:
                body["weight_version"] = str(weight_version)
            await self.request("POST", "/update_weights_from_tensor", body)

        sent = False
        for bucket, last in buckets_with_last(named_tensors, self.bucket_bytes):
            await send(bucket, last)
            sent = True
        if not sent and weight_version is not None:  # no tensors: only the version moves
            await self.request("POST", "/update_weight_version",
                               {"new_version": str(weight_version),
                                "abort_all_requests": False})
        if weight_version is not None:
            self._weight_version = weight_version

    async def shared_weights(self) -> dict[str, Any] | None:
        """The layout of the engine's parameters in shared memory (the embedded engine moves
        them there on this call); None for an engine without the route (SGLang). Its
        `control` address, where given, carries the begin and commit from then on
        (engines/write_control.py)."""
        try:
            layout = await self.request("POST", "/shared_weights")
        except EngineError as e:
            if e.status in (404, 405):
                return None
            raise
        await self._drop_write_control()
        control = layout.get("control") if isinstance(layout, dict) else None
        if control is not None and self.use_write_control:
            try:
                self._write_control = WriteControlClient(control, self.timeout_s)
            except ValueError as e:
                raise EngineError(f"POST {self.url}/shared_weights: {e}",
                                  endpoint="/shared_weights") from None
        return layout

    async def begin_shared_write(self) -> str:
        """Hold the engine's steps for a write; returns its segment's name."""
        reply = await self._write_call({"op": "begin"}, "/shared_weights/begin")
        return str(reply.get("segment")) if isinstance(reply, dict) else ""

    async def commit_shared_write(self, weight_version: int) -> None:
        await self._write_call({"op": "commit", "weight_version": str(weight_version)},
                               "/shared_weights/commit")
        self._weight_version = weight_version

    async def _write_call(self, body: dict[str, Any], endpoint: str) -> Any:
        """Over the engine's write control where it has one; over HTTP where it has none or
        the socket is gone (a restarted engine: its begin returns a new segment, and the
        writer maps it again)."""
        if self._write_control is not None:
            try:
                return await self._write_control.call(body)
            except ConnectionError:
                await self._drop_write_control()
        return await self.request("POST", endpoint,
                                  {k: v for k, v in body.items() if k != "op"} or None)

    async def _drop_write_control(self) -> None:
        if self._write_control is not None:
            await self._write_control.close()
            self._write_control = None

    async def update_weights_from_disk(self, path: str, weight_version: int,
                                       load_format: str | None = None) -> None:
        body: dict[str, Any] = {"model_path": str(path), "weight_version": str(weight_version),
                                "flush_cache": True, "abort_all_requests": False}
        if load_format is not None:
            body["load_format"] = load_format
        await self.request("POST", "/update_weights_from_disk", body)
        self._weight_version = weight_version

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, *,
                                        group_name: str = DEFAULT_GROUP,
                                        backend: str = "nccl") -> None:
        """Make the server's ranks join the trainer's broadcast group (rank 0 = trainer)."""
        await self.request("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend})

    async def update_weights_from_distributed(
            self, names: list[str], dtypes: list[torch.dtype | str], shapes: list[list[int]],
            weight_version: int | None = None, *, group_name: str = DEFAULT_GROUP,
            flattened: bool = False, flush_cache: bool = True) -> None:
        """Announce one broadcast; the call returns once the server has received it, so run
        it concurrently with the caller's `torch.distributed.broadcast` from rank 0."""
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": [d if isinstance(d, str) else dtype_name(d) for d in dtypes],
            "shapes": [list(s) for s in shapes], "group_name": group_name,
            "flush_cache": flush_cache, "abort_all_requests": False}
        if flattened:
            body["load_format"] = FLATTENED
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        await self.request("POST", "/update_weights_from_distributed", body)
        if weight_version is not None:
            self._weight_version = weight_version

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> None:
        await self.request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def get_weight_version(self) -> int:
        """The server's current version (GET /model_info); also refreshes `weight_version`."""
        info = await self.request("GET", "/model_info")
        self._weight_version = parse_version(info.get("weight_version"), "/model_info")
        return self._weight_version

    # -- memory, cache, health -----------------------------------------------------------------

    async def release_memory(self, tags: list[str] | None = None) -> None:
        await self.request("POST", "/release_memory_occupation",
                           {} if tags is None else {"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self.request("POST", "/resume_memory_occupation",
                           {} if tags is None else {"tags": tags})

    async def flush_cache(self) -> None:
        await self.request("POST", "/flush_cache")

    async def health(self, timeout_s: float = 5.0) -> bool:
        try:
            await self.request("GET", "/health", timeout_s=timeout_s)
        except EngineError:
            return False
        return True
