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

    python -m megatron_rl.rollout.engines.embedded --model DIR --port 0   # prints the URL
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import concurrent.futures
import difflib
import json
import logging
import queue
import secrets
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aiohttp import web

from megatron_rl.rollout.engines.tensors import (
    FLATTENED,
    SharedBucket,
    decode_safetensors,
    shm_header,
)

log = logging.getLogger(__name__)

_EPS = 1e-6  # SGLang: temperature below this is greedy


class BadRequest(ValueError):
    """A request the engine refuses (HTTP 400 unless `status` says otherwise)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------------------------
# request parsing
# ---------------------------------------------------------------------------------------------

# /generate fields served here; any other GenerateReqInput field gets a 400 naming it
_GENERATE_FIELDS = {"rid", "input_ids", "text", "sampling_params", "return_logprob",
                    "return_routed_experts", "stream", "logprob_start_len", "top_logprobs_num",
                    "return_text_in_logprobs", "routed_experts_start_len", "log_metrics"}
_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "max_new_tokens", "min_new_tokens",
                    "stop_token_ids", "ignore_eos", "sampling_seed", "skip_special_tokens",
                    "spaces_between_special_tokens", "no_stop_trim", "n", "stop"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _typed(d: dict[str, Any], key: str, kind: str, default: Any, where: str) -> Any:
    v = d.get(key)
    if v is None:
        return default
    ok = {"int": _is_int(v), "bool": isinstance(v, bool), "str": isinstance(v, str),
          "float": _is_int(v) or isinstance(v, float)}[kind]
    if not ok:
        raise BadRequest(f"{where}{key}: expected {kind}, got {v!r}")
    return float(v) if kind == "float" else v


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    @classmethod
    def parse(cls, sp: Any, vocab_size: int) -> Sampling:
        if sp is None:
            sp = {}
        if not isinstance(sp, dict):
            raise BadRequest(f"sampling_params: expected an object, got {sp!r}")
        unknown = sorted(set(sp) - _SAMPLING_FIELDS)
        if unknown:
            raise BadRequest(f"sampling_params.{unknown[0]}: not supported by the embedded engine")
        w = "sampling_params."
        s = cls(temperature=_typed(sp, "temperature", "float", 1.0, w),
                top_p=_typed(sp, "top_p", "float", 1.0, w),
                top_k=_typed(sp, "top_k", "int", -1, w),
                max_new_tokens=_typed(sp, "max_new_tokens", "int", 128, w),
                min_new_tokens=_typed(sp, "min_new_tokens", "int", 0, w),
                ignore_eos=_typed(sp, "ignore_eos", "bool", False, w),
                seed=_typed(sp, "sampling_seed", "int", None, w),
                skip_special_tokens=_typed(sp, "skip_special_tokens", "bool", True, w))
        stops = sp.get("stop_token_ids") or []
        if not isinstance(stops, list) or not all(_is_int(t) for t in stops):
            raise BadRequest(f"sampling_params.stop_token_ids: expected a list of token ids, "
                             f"got {stops!r}")
        s.stop_token_ids = tuple(stops)
        if _typed(sp, "n", "int", 1, w) != 1:
            raise BadRequest("sampling_params.n: only n=1 is supported by the embedded engine")
        if sp.get("stop"):
            raise BadRequest("sampling_params.stop: stop strings are not supported by the "
                             "embedded engine (use stop_token_ids)")
        if s.temperature < 0:
            raise BadRequest(f"sampling_params.temperature: must be >= 0, got {s.temperature}")
        if not 0 < s.top_p <= 1:
            raise BadRequest(f"sampling_params.top_p: must be in (0, 1], got {s.top_p}")
        if s.top_k == 0 or s.top_k < -1:
            raise BadRequest(f"sampling_params.top_k: must be -1 or >= 1, got {s.top_k}")
        if s.max_new_tokens < 0 or s.min_new_tokens < 0:
            raise BadRequest("sampling_params.max_new_tokens/min_new_tokens: must be >= 0")
        if s.top_k == -1 or s.top_k > vocab_size:
            s.top_k = vocab_size
        return s


@dataclass
class Seq:
    """One request's state, owned by the scheduler thread."""

    rid: str
    prompt: list[int]
    sampling: Sampling
    return_logprob: bool
    return_routed: bool
    future: concurrent.futures.Future
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    routed: list[np.ndarray] = field(default_factory=list)  # [layers, top_k] per fed token
    generator: torch.Generator | None = None
    finish: dict[str, Any] | None = None
    started: float = field(default_factory=time.monotonic)


# ---------------------------------------------------------------------------------------------
# weights: checkpoint (HF file) names → slices of the live parameters
# ---------------------------------------------------------------------------------------------


class WeightLoader:
    """Maps HF checkpoint names (as in model.safetensors, e.g. per-expert
    `mlp.experts.3.gate_proj.weight`) and the model's own state_dict names onto its parameters.

    transformers fuses some checkpoint tensors in memory (experts into `gate_up_proj`), so the
    map is derived from transformers' own save-time conversion run on a probe state dict of
    element ids: each checkpoint name maps to one parameter and the element positions it fills.
    """

    def __init__(self, model: torch.nn.Module):
        from transformers.core_model_loading import revert_weight_conversion

        self.model = model
        self.targets = model.state_dict(keep_vars=True)
        self.map: dict[str, tuple[str, slice | torch.Tensor, tuple[int, ...]]] = {}
        starts, names, probe, off = [], [], {}, 0
        for name, t in self.targets.items():
            probe[name] = torch.arange(off, off + t.numel()).view(t.shape)
            starts.append(off)
            names.append(name)
            off += t.numel()
            self.map[name] = (name, slice(0, t.numel()), tuple(t.shape))
        starts_t = torch.tensor(starts)
        for ckpt_name, ids in revert_weight_conversion(model, probe).items():
            shape, ids = tuple(ids.shape), ids.reshape(-1)
            i = int(torch.searchsorted(starts_t, ids[0], right=True)) - 1
            target, local = names[i], ids - starts[i]
            first = int(local[0])
            contiguous = bool((local == torch.arange(first, first + len(local))).all())
            where = slice(first, first + len(local)) if contiguous else local
            self.map[ckpt_name] = (target, where, shape)

    def validate(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            if name not in self.map:
                close = difflib.get_close_matches(name, list(self.map), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise BadRequest(f"unknown tensor '{name}': not a weight of "
                                 f"{type(self.model).__name__}{hint}")
            expected = self.map[name][2]
            if tuple(t.shape) != expected:
                raise BadRequest(f"tensor '{name}': expected shape {list(expected)} but found "
                                 f"{list(t.shape)}")
            if not (t.is_floating_point() or t.dtype == torch.uint8):
                raise BadRequest(f"tensor '{name}': dtype {t.dtype} is not a float type")

    @torch.no_grad()
    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """All-or-nothing: validates every tensor before touching any weight."""
        self.validate(named)
        for name, t in named:
            target, where, _ = self.map[name]
            flat = self.targets[target].data.view(-1)
            flat[where] = t.reshape(-1).to(flat.dtype)

    def coverage_gaps(self, names: list[str]) -> list[str]:
        """Parameters a full checkpoint with `names` leaves (partly) unwritten."""
        filled = {n: torch.zeros(t.numel(), dtype=torch.bool) for n, t in self.targets.items()}
        for name in names:
            target, where, _ = self.map[name]
            filled[target][where] = True
        tied = {n for n, t in self.targets.items()
                for m, u in self.targets.items() if m != n and u is t and filled[m].all()}
        return [n for n, f in filled.items() if not f.all() and n not in tied]


# ---------------------------------------------------------------------------------------------
# the scheduler (one thread owns the model)
# ---------------------------------------------------------------------------------------------


class EmbeddedCore:
    """Continuous-batching generation over a HF causal LM, plus control calls between steps."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, weight_version: int = 0,
                 max_batch_size: int = 32, return_original_logprob: bool = False,
                 context_length: int | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.context_length = int(context_length or getattr(cfg, "max_position_embeddings", 0)
                                  or 1 << 30)
        self.num_experts = getattr(cfg, "num_experts", None)
        self.top_k_experts = getattr(cfg, "num_experts_per_tok", None)
        self.eos_ids = self._eos_ids()
        self.max_batch_size = max_batch_size
        self.return_original_logprob = return_original_logprob
        self.weight_version = str(weight_version)
        self.paused = False
        self.released = False
        self.pending: collections.deque[Seq] = collections.deque()
        self.batch: list[Seq] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None
        self.rids: set[str] = set()
        self.inbox: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.max_running = 0  # the largest batch decoded so far (a sign batching happened)
        self.admitting: list[Seq] = []  # taken from pending, not yet in the batch
        self.weights = WeightLoader(model)
        self.thread = threading.Thread(target=self._loop, name="embedded-engine", daemon=True)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config,
                    self.tokenizer):
            v = getattr(src, "eos_token_id", None) if src is not None else None
            ids.update([v] if _is_int(v) else (v or []))
        return {i for i in ids if 0 <= i < self.vocab_size}

    # -- thread-facing API (any thread) --------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.inbox.put(("stop", None))
        self.thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def submit(self, seq: Seq) -> None:
        self.inbox.put(("seq", seq))

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the scheduler thread between two steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put(("call", (fn, fut)))
        return fut

    # -- scheduler thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            busy = bool(self.batch or self.pending) and not self.paused and not self.released
            items = [] if busy else [self.inbox.get()]
            while True:
                try:
                    items.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for kind, payload in items:
                if kind == "stop":
                    self._fail_all(RuntimeError("engine stopped"))
                    return
                if kind == "seq":
                    if payload.sampling.max_new_tokens == 0:  # nothing to generate
                        self._finish(payload, {"type": "length", "length": 0})
                    else:
                        self.pending.append(payload)
                else:
                    fn, fut = payload
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # the caller gets it; the engine goes on
                        fut.set_exception(e)
            if self.paused or self.released:
                continue
            try:
                if self.pending and len(self.batch) < self.max_batch_size:
                    self._admit()
                if self.batch:
                    self._decode()
            except Exception as e:  # a model failure fails the in-flight requests, not the server
                log.exception("embedded engine step failed")
                self._fail_all(e)

    def _fail_all(self, e: BaseException) -> None:
        for s in [*self.admitting, *self.batch, *self.pending]:
            self.rids.discard(s.rid)
            if not s.future.done():
                s.future.set_exception(e)
        self.batch, self.pending, self.cache, self.mask = [], collections.deque(), None, None
        self.admitting = []

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any,
                 routed: bool) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         past_key_values=cache, use_cache=True, logits_to_keep=1,
                         **({"output_router_logits": True} if routed else {}))
        experts = None
        if routed:  # per layer [B*L, E] → [B, L, layers, top_k]
            b, n = ids.shape
            experts = torch.stack([torch.topk(r.view(b, n, -1), self.top_k_experts, dim=-1)
                                   .indices for r in out.router_logits], dim=2)
        return out.logits[:, -1, :].float(), out.past_key_values, experts

    def _admit(self) -> None:
        from transformers import DynamicCache

        group = self.admitting = []
        while self.pending and len(self.batch) + len(group) < self.max_batch_size:
            group.append(self.pending.popleft())
        # a retracted request comes back with its output so far: prefill prompt + output
        toks = [s.prompt + s.out for s in group]
        width = max(len(t) for t in toks)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for i, t in enumerate(toks):
            ids[i, width - len(t):] = torch.tensor(t)
            mask[i, width - len(t):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        routed = any(s.return_routed for s in group)
        logits, cache, experts = self._forward(ids, mask, pos, DynamicCache(), routed)
        if experts is not None:
            for i, s in enumerate(group):
                s.routed = list(experts[i, width - len(toks[i]):].numpy().astype(np.int32))
        self._sample(group, logits)
        keep = [i for i, s in enumerate(group) if s.finish is None]
        self._merge([group[i] for i in keep], cache, mask, keep)
        self.admitting = []

    def _decode(self) -> None:
        ids = torch.tensor([[s.out[-1]] for s in self.batch])
        pos = self.mask.sum(-1, keepdim=True)
        self.mask = torch.cat([self.mask, torch.ones(len(self.batch), 1, dtype=torch.long)], -1)
        routed = any(s.return_routed for s in self.batch)
        logits, self.cache, experts = self._forward(ids, self.mask, pos, self.cache, routed)
        if experts is not None:
            for i, s in enumerate(self.batch):
                s.routed.append(experts[i, 0].numpy().astype(np.int32))
        self._sample(self.batch, logits)
        self._retire()

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        for i, s in enumerate(seqs):
            row, sp = logits[i], s.sampling
            if len(s.out) < sp.min_new_tokens:  # SGLang's min_new_tokens penalizer
                row = row.clone()
                row[list(set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_ids))] = (
                    float("-inf"))
            if sp.greedy:
                tok = int(torch.argmax(row))
                scaled = row
            else:
                scaled = row / sp.temperature
                tok = self._draw(scaled, sp, s)
            lp_source = row if self.return_original_logprob else scaled
            s.out.append(tok)
            s.logprobs.append(float(torch.log_softmax(lp_source, -1)[tok]))
            s.versions.append(self.weight_version)
            if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_ids):
                self._finish(s, {"type": "stop", "matched": tok})
            elif len(s.out) >= sp.max_new_tokens or len(s.prompt) + len(s.out) >= (
                    self.context_length):
                self._finish(s, {"type": "length", "length": len(s.out)})

    def _draw(self, scaled: torch.Tensor, sp: Sampling, s: Seq) -> int:
        if s.generator is None:
            s.generator = torch.Generator().manual_seed(
                sp.seed if sp.seed is not None else secrets.randbits(63))
        probs = torch.softmax(scaled, -1)
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.arange(len(sorted_p)) < sp.top_k
        # top-p keeps the smallest prefix whose mass reaches top_p (the first token always)
        keep &= (torch.cumsum(sorted_p, -1) - sorted_p) < sp.top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros(()))
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=s.generator)
        return int(order[choice])

    def _merge(self, seqs: list[Seq], cache: Any, mask: torch.Tensor, rows: list[int]) -> None:
        """Append prefilled rows to the running batch, left-padding the shorter KV cache."""
        if not seqs:
            return
        idx = torch.tensor(rows)
        mask = mask[idx]
        new_layers = [(layer.keys[idx], layer.values[idx]) for layer in cache.layers]
        if not self.batch:
            for layer, (k, v) in zip(cache.layers, new_layers):
                layer.keys, layer.values = k, v
            self.batch, self.cache, self.mask = list(seqs), cache, mask
            self.max_running = max(self.max_running, len(self.batch))
            return
        t_old, t_new = self.mask.shape[1], mask.shape[1]
        width = max(t_old, t_new)

        def pad(x: torch.Tensor, t: int, dim: int) -> torch.Tensor:
            if t == width:
                return x
            shape = list(x.shape)
            shape[dim] = width - t
            return torch.cat([x.new_zeros(shape), x], dim)

        for layer, (k, v) in zip(self.cache.layers, new_layers):
            layer.keys = torch.cat([pad(layer.keys, t_old, 2), pad(k, t_new, 2)], 0)
            layer.values = torch.cat([pad(layer.values, t_old, 2), pad(v, t_new, 2)], 0)
        self.mask = torch.cat([pad(self.mask, t_old, 1), pad(mask, t_new, 1)], 0)
        self.batch.extend(seqs)
        self.max_running = max(self.max_running, len(self.batch))

    def _retire(self) -> None:
        """Drop finished rows and the left columns no remaining row uses."""
        keep = [i for i, s in enumerate(self.batch) if s.finish is None]
        if len(keep) == len(self.batch):
            return
        self.batch = [self.batch[i] for i in keep]
        if not self.batch:
            self.cache, self.mask = None, None
            return
        idx = torch.tensor(keep)
        mask = self.mask[idx]
        start = int((mask.sum(0) > 0).nonzero()[0])
        self.mask = mask[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx, :, start:]
            layer.values = layer.values[idx, :, start:]

    def _finish(self, s: Seq, reason: dict[str, Any]) -> None:
        s.finish = reason
        self.rids.discard(s.rid)
        if not s.future.done():
            s.future.set_result(self._response(s))

    def _response(self, s: Seq) -> dict[str, Any]:
        spans: list[dict[str, Any]] = []
        for i, v in enumerate(s.versions):
            if spans and spans[-1]["version"] == v:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": v, "start": i, "end": i + 1})
        meta: dict[str, Any] = {
            "id": s.rid, "finish_reason": s.finish, "prompt_tokens": len(s.prompt),
            "completion_tokens": len(s.out), "cached_tokens": 0,
            "weight_version": spans[-1]["version"] if spans else self.weight_version,
            "weight_versions": spans, "e2e_latency": time.monotonic() - s.started}
        if s.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s.logprobs, s.out)]
        if s.return_routed:
            arr = (np.stack(s.routed) if s.routed
                   else np.zeros((0, 0, 0), np.int32)).astype(np.int32)
            meta["routed_experts"] = base64.b64encode(arr.tobytes()).decode("ascii")
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(s.out, skip_special_tokens=s.sampling.skip_special_tokens)
        return {"text": text, "output_ids": list(s.out), "meta_info": meta}

    # -- control calls (run on the scheduler thread via `call`) --------------------------------

    def abort(self, rid: str | None, abort_all: bool = False,
              message: str = "Aborted by /abort_request") -> int:
        n = 0
        for s in [*self.pending, *self.batch]:
            if abort_all or s.rid == rid:
                self._finish(s, {"type": "abort", "message": message})
                n += 1
        self.pending = collections.deque(s for s in self.pending if s.finish is None)
        self._retire()
        return n

    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort(None, abort_all=True, message="Aborted by /pause_generation")
        elif mode == "retract":
            # back to the queue; on continue each is prefilled again from prompt + output
            self.pending.extendleft(reversed(self.batch))
            self.batch, self.cache, self.mask = [], None, None
        elif mode != "in_place":
            raise BadRequest(f"mode: expected 'abort', 'retract' or 'in_place', got {mode!r}")
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    @staticmethod
    def _check_version(version: Any) -> None:
        # SGLang's versions are strings; the protocol's are integers, sent as str(int)
        try:
            int(version)
        except (TypeError, ValueError):
            raise BadRequest(f"weight_version: expected an integer string, got {version!r}"
                             ) from None

    def set_version(self, version: Any) -> None:
        if version is not None:
            self._check_version(version)
            self.weight_version = str(version)

    def load_weights(self, named: list[tuple[str, torch.Tensor]], version: Any,
                     require_complete: bool = False) -> None:
        if version is not None:
            self._check_version(version)  # before any weight is written
        self.weights.validate(named)
        if require_complete:
            gaps = self.weights.coverage_gaps([n for n, _ in named])
            if gaps:
                raise BadRequest(f"checkpoint leaves {len(gaps)} weights unset, e.g. "
                                 f"'{gaps[0]}'")
        self.weights.load(named)
        self.set_version(version)

    def release(self) -> None:
        if self.batch:
            raise BadRequest(f"cannot release memory with {len(self.batch)} requests decoding; "
                             "pause generation (retract or abort) first")
        self.released = True

    def info(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "paused": self.paused,
                "released": self.released, "max_batch_size": self.max_batch_size,
                "running": {s.rid: len(s.out) for s in self.batch},
                "max_running": self.max_running,
                "waiting": [s.rid for s in self.pending],
                "return_original_logprob": self.return_original_logprob,
                "context_length": self.context_length}


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
        unknown = sorted(set(body) - _GENERATE_FIELDS)
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
        if not (isinstance(ids, list) and ids and all(_is_int(t) for t in ids)):
            raise BadRequest(f"input_ids: expected a non-empty list of token ids, got "
                             f"{str(ids)[:80]}")
        bad = [t for t in ids if not 0 <= t < self.core.vocab_size]
        if bad:
            raise BadRequest(f"input_ids: token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.core.vocab_size})")
        if len(ids) >= self.core.context_length:
            raise BadRequest(f"input_ids: {len(ids)} tokens exceed the context length "
                             f"{self.core.context_length}")
        routed = _typed(body, "return_routed_experts", "bool", False, "")
        if routed and not self.core.num_experts:
            raise BadRequest("return_routed_experts: the model has no experts")
        return Seq(rid=rid, prompt=list(ids),
                   sampling=Sampling.parse(body.get("sampling_params"), self.core.vocab_size),
                   return_logprob=bool(_typed(body, "return_logprob", "bool", False, "")),
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
        host = _typed(body, "master_address", "str", None, "")
        port = _typed(body, "master_port", "int", None, "")
        rank = _typed(body, "rank_offset", "int", None, "")
        world = _typed(body, "world_size", "int", None, "")
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
