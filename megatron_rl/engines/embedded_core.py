"""The embedded engine's core: continuous-batching generation over a transformers causal LM,
with control calls (abort, pause, versioned weight updates) applied between decode steps.
`embedded.py` serves it over SGLang's HTTP API.
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import contextlib
import difflib
import functools
import inspect
import json
import logging
import math
import queue
import reprlib
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megatron_rl.checkpoint.fp8 import FP8_DTYPE, SCALE_SUFFIX, dequantize_named
from megatron_rl.engines.base import MEMORY_TAGS  # SGLang's tags; none given = all
from megatron_rl.engines.lean_decode import lean_decode, pad_bias
from megatron_rl.engines.output_layer import TransposedOutputLayer, transpose_output_layer
from megatron_rl.engines.prefix_cache import PrefixCache
from megatron_rl.engines.shared_weights import SharedWeightStore
from megatron_rl.utils.parallel_copy import Pairs, copy_all, copy_shares

log = logging.getLogger(__name__)

_EPS = 1e-6  # SGLang: temperature below this is greedy
# a prefill pass's fixed cost in tokens' worth of work (the tiny models on one CPU thread: a
# pass of 1 row costs about what 200 more tokens do), for grouping prompts by length
PREFILL_CALL_TOKENS = 256
SLAB_SPARE = 256  # spare KV cache columns at most, allocated ahead of the decode steps


def memory_tags(tags: Any) -> set[str]:
    """The regions a release/resume body names (None: all), checked."""
    if tags is None:
        return set(MEMORY_TAGS)
    if not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise BadRequest(f"tags: expected a list of strings, got {show(tags)}")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise BadRequest(f"tags: unknown memory type {unknown[0]!r}; expected "
                         f"{', '.join(MEMORY_TAGS)}")
    return set(tags)


class BadRequest(ValueError):
    """A request the engine refuses (HTTP 400 unless `status` says otherwise)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------------------------
# request parsing: everything a request carries is checked here, so a decode step never meets
# a value it cannot handle (one bad request must not fail a batch)
# ---------------------------------------------------------------------------------------------

# /generate fields served here; any other GenerateReqInput field gets a 400 naming it
GENERATE_FIELDS = {"rid", "input_ids", "text", "sampling_params", "return_logprob",
                    "return_routed_experts", "stream", "logprob_start_len", "top_logprobs_num",
                    "return_text_in_logprobs", "routed_experts_start_len", "log_metrics"}
_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "max_new_tokens", "min_new_tokens",
                    "stop_token_ids", "ignore_eos", "sampling_seed", "skip_special_tokens",
                    "spaces_between_special_tokens", "no_stop_trim", "n", "stop"}

MAX_SEED = 2**63 - 1          # SGLang keeps sampling seeds in an int64 tensor
MAX_TEMPERATURE = 1e4         # far above any useful value; keeps logits / T finite in fp32
MAX_NEW_TOKENS = 2**31 - 1
MAX_STOP_TOKEN_IDS = 1024
MAX_RID_CHARS = 1024
MAX_JSON_DEPTH = 32           # /generate needs 3; weight-update bodies 3

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 60


def show(v: Any) -> str:
    """A short repr for error messages (request values can be huge or deeply nested)."""
    try:
        return _SHOW.repr(v)
    except ValueError:  # an int past Python's int-to-str digit limit
        return "<a number too large to print>"


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def typed_field(d: dict[str, Any], key: str, kind: str, default: Any, where: str) -> Any:
    v = d.get(key)
    if v is None:
        return default
    ok = {"int": is_int(v), "bool": isinstance(v, bool), "str": isinstance(v, str),
          "float": is_int(v) or isinstance(v, float)}[kind]
    if not ok:
        raise BadRequest(f"{where}{key}: expected {kind}, got {show(v)}")
    if kind == "float":
        try:
            v = float(v)
        except OverflowError:  # an integer beyond float range
            v = math.inf
        if not math.isfinite(v):
            raise BadRequest(f"{where}{key}: expected a finite number, got {show(d[key])}")
    return v


def _in_range(where: str, v: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if (v <= lo if lo_open else v < lo) or v > hi:
        bound = "(" if lo_open else "["
        raise BadRequest(f"{where}: must be in {bound}{lo:g}, {hi:g}], got {show(v)}")


JSON_SCALARS = frozenset({int, float, str, bool, type(None)})  # json.loads' other types


def parse_json_object(raw: bytes, where: str = "request body") -> dict[str, Any]:
    """A request body: one JSON object, nested at most MAX_JSON_DEPTH deep (400 otherwise)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest(f"{where}: JSON nested too deeply (at most {MAX_JSON_DEPTH} "
                         "levels)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise BadRequest(f"{where} is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"{where}: expected a JSON object, got {type(body).__name__}")
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:  # iterative: the depth check itself must not recurse
        v, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
        children = v.values() if isinstance(v, dict) else v
        if JSON_SCALARS.issuperset(map(type, children)):  # e.g. input_ids: no Python loop
            continue
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return body


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
            raise BadRequest(f"sampling_params: expected an object, got {show(sp)}")
        unknown = sorted(set(sp) - _SAMPLING_FIELDS)
        if unknown:
            raise BadRequest(f"sampling_params.{unknown[0][:60]}: not supported by the "
                             "embedded engine")
        w = "sampling_params."
        s = cls(temperature=typed_field(sp, "temperature", "float", 1.0, w),
                top_p=typed_field(sp, "top_p", "float", 1.0, w),
                top_k=typed_field(sp, "top_k", "int", -1, w),
                max_new_tokens=typed_field(sp, "max_new_tokens", "int", 128, w),
                min_new_tokens=typed_field(sp, "min_new_tokens", "int", 0, w),
                ignore_eos=typed_field(sp, "ignore_eos", "bool", False, w),
                seed=typed_field(sp, "sampling_seed", "int", None, w),
                skip_special_tokens=typed_field(sp, "skip_special_tokens", "bool", True, w))
        for key in ("spaces_between_special_tokens", "no_stop_trim"):
            typed_field(sp, key, "bool", None, w)
        stops = sp.get("stop_token_ids") or []
        if not isinstance(stops, list) or not all(is_int(t) for t in stops):
            raise BadRequest(f"sampling_params.stop_token_ids: expected a list of token ids, "
                             f"got {show(stops)}")
        if len(stops) > MAX_STOP_TOKEN_IDS:
            raise BadRequest(f"sampling_params.stop_token_ids: {len(stops)} ids, at most "
                             f"{MAX_STOP_TOKEN_IDS}")
        bad = [t for t in stops if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"sampling_params.stop_token_ids: token id {show(bad[0])} is "
                             f"outside the vocabulary [0, {vocab_size})")
        s.stop_token_ids = tuple(dict.fromkeys(stops))
        if typed_field(sp, "n", "int", 1, w) != 1:
            raise BadRequest("sampling_params.n: only n=1 is supported by the embedded engine")
        if sp.get("stop"):
            raise BadRequest("sampling_params.stop: stop strings are not supported by the "
                             "embedded engine (use stop_token_ids)")
        _in_range(w + "temperature", s.temperature, 0, MAX_TEMPERATURE)
        _in_range(w + "top_p", s.top_p, 0, 1, lo_open=True)
        if s.top_k == 0 or s.top_k < -1:
            raise BadRequest(f"sampling_params.top_k: must be -1 or >= 1, got {show(s.top_k)}")
        _in_range(w + "max_new_tokens", s.max_new_tokens, 0, MAX_NEW_TOKENS)
        _in_range(w + "min_new_tokens", s.min_new_tokens, 0, MAX_NEW_TOKENS)
        if s.seed is not None:
            _in_range(w + "sampling_seed", s.seed, 0, MAX_SEED)
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


# a prefill pass's rows that go on decoding: (those Seqs, their rows in the pass, the pass's
# KV cache, each row's padding, the pass's width)
_Part = tuple[list[Seq], list[int], Any, torch.Tensor, int]


def parse_generate(body: dict[str, Any], *, vocab_size: int, context_length: int,
                   tokenizer: Any = None, has_routers: bool = False) -> Seq:
    """A /generate body → a Seq ready to schedule, or BadRequest naming the field.

    Pure (no engine state), so it can be fuzzed directly; whatever it accepts the decode step
    can run."""
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if unknown:
        raise BadRequest(f"{unknown[0][:60]}: not supported by the embedded engine")
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
        raise BadRequest(f"rid: expected a string, got {show(rid)}")
    if len(rid) > MAX_RID_CHARS:
        raise BadRequest(f"rid: {len(rid)} characters, at most {MAX_RID_CHARS}")
    ids = body.get("input_ids")
    if ids is None and body.get("text") is not None:
        text = body["text"]
        if tokenizer is None:
            raise BadRequest("text: this server has no tokenizer; send input_ids")
        if not isinstance(text, str):
            raise BadRequest("text: expected a string (batches are not supported)")
        try:
            ids = list(tokenizer.encode(text, add_special_tokens=False))
        except Exception as e:  # e.g. lone surrogates the tokenizer cannot encode
            raise BadRequest(f"text: cannot be tokenized ({type(e).__name__})") from None
        if not ids:
            raise BadRequest("text: encodes to no tokens")
    if ids is None:
        raise BadRequest("input_ids: required (a non-empty list of token ids)")
    # a set of the element types first: a prompt's thousands of ids without a Python loop
    if not (isinstance(ids, list) and ids
            and (set(map(type, ids)) == {int} or all(is_int(t) for t in ids))):
        raise BadRequest(f"input_ids: expected a non-empty list of token ids, got {show(ids)}")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise BadRequest(f"input_ids: token id {show(bad[0])} is outside the vocabulary "
                         f"[0, {vocab_size})")
    if len(ids) >= context_length:
        raise BadRequest(f"input_ids: {len(ids)} tokens exceed the context length "
                         f"{context_length}")
    routed = typed_field(body, "return_routed_experts", "bool", False, "")
    if routed and not has_routers:
        raise BadRequest("return_routed_experts: the model has no experts (or no router "
                         "transformers can record)")
    return Seq(rid=rid, prompt=list(ids), sampling=Sampling.parse(body.get("sampling_params"),
                                                                  vocab_size),
               return_logprob=typed_field(body, "return_logprob", "bool", False, ""),
               return_routed=routed, future=concurrent.futures.Future())


def router_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """The MoE routers of a transformers model, in layer order, with the index of the router
    logits in their output: what its `output_router_logits` records (`_can_record_outputs`)."""
    rec = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if rec is None:
        return []
    target = getattr(rec, "target_class", rec)
    index = getattr(rec, "index", 0)
    where = getattr(rec, "layer_name", None)
    return [(m, index) for name, m in model.named_modules()
            if isinstance(m, target) and (where is None or where in name)]


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
        runs: Pairs = []  # parameter runs the tensors fill, copied over the cores at once
        for name, t in named:
            target, where, _ = self.map[name]
            flat = self.targets[target].data.view(-1)
            if isinstance(where, slice):
                runs.append((flat[where], t.reshape(-1)))
            else:
                flat[where] = t.reshape(-1).to(flat.dtype)
        # tied parameters take two names: one after the other, in the order given
        tied = len({d.data_ptr() for d, _ in runs}) < len(runs)
        copy_all([runs] if tied else copy_shares(runs))

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
                 context_length: int | None = None,
                 prefill_call_tokens: int = PREFILL_CALL_TOKENS, threads: int | None = None,
                 prefix_cache: bool = True, fast_output_layer: bool = False):
        self.model = model.eval()
        self.fused_norms = fuse_rms_norms(model)
        # intra-op threads of the engine's own thread (OpenMP's setting is per thread). A tiny
        # model's decode step is per-op overhead: 2 threads ran batches of 8-16 rows at 0.65-0.8x
        # the tokens/s of 1 (benchmarks/engine_vs_generate.py --threads)
        self.threads = threads
        # opt-in (`rollout.fast_output_layer`): logits of 1-3 rows within float rounding of
        # F.linear's, F.linear's own from 4 rows on
        self.output_layer = (transpose_output_layer(model) if fast_output_layer
                             else None)  # rebuilt on weight loads
        self.tokenizer = tokenizer
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.context_length = int(context_length or getattr(cfg, "max_position_embeddings", 0)
                                  or 1 << 30)
        self.num_experts = getattr(cfg, "num_experts", None)
        self.top_k_experts = getattr(cfg, "num_experts_per_tok", None)
        self.routers = router_modules(model) if self.num_experts else []
        self.eos_ids = self._eos_ids()
        self.max_batch_size = max_batch_size
        self.return_original_logprob = return_original_logprob
        self.weight_version = str(weight_version)
        self.paused = False
        self.released_tags: set[str] = set()  # SGLang memory regions now released
        # memory and weight calls as applied, in order (release/resume + tags, load_weights)
        self.control_log: list[tuple[str, tuple[str, ...]]] = []
        self.pending: collections.deque[Seq] = collections.deque()
        self.batch: list[Seq] = []
        # the running rows' KV cache: right-aligned (every row's last token in the last column)
        # in `SlabLayer`s with spare columns; row i's first `pad[i]` of `width` columns are
        # padding. Recurrent (Gated DeltaNet) layers hold one state per row.
        self.cache: Any = None
        self.pad: torch.Tensor | None = None
        self.width = 0
        self.padded = False        # some row has padding (else no mask at all)
        self.step_bias: torch.Tensor | None = None  # decode-step additive mask, spare columns
        self.prefill_call_tokens = prefill_call_tokens
        self.attention = attention_mode(model)
        # decode steps through the decoder's layers directly, where that is exactly the model
        self.decode_step = lean_decode(model, self.attention)
        self.dtype = next(model.parameters()).dtype
        self.inference_mode = keeps_no_state(model)
        # cached prompt prefixes (prefix_cache.py): where the engine passes the padding as a
        # bias, so a pass may hold its rows' padding between a cached prefix and the rest
        self.prefixes = (PrefixCache() if prefix_cache and self.attention == "bias"
                         and plain_attention_cache(model) else None)
        self.rids: set[str] = set()
        self.inbox: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.max_running = 0  # the largest batch decoded so far (a sign batching happened)
        self.admitting: list[Seq] = []  # taken from pending, not yet in the batch
        self.stepping: list[Seq] = []   # the rows of the forward pass under way
        # finished requests' answers (future, result, error), sent together after the step:
        # each sent alone wakes the caller's loop, which then takes the GIL from the step
        self.answers: list[tuple[concurrent.futures.Future, Any, BaseException | None]] = []
        self.busy_seconds = 0.0  # spent in prefill and decode steps (generation proper)
        self.weights = WeightLoader(model)
        self.shared: SharedWeightStore | None = None  # parameters in shared memory, on ask
        self.writing = False  # a trainer is writing the shared weights: no step may run
        self.thread = threading.Thread(target=self._loop, name="embedded-engine", daemon=True)

    @property
    def held(self) -> bool:
        """No step may run: paused, memory released, or shared weights being written."""
        return self.paused or self.released or self.writing

    @property
    def released(self) -> bool:
        """Some memory region is released: no generation until all are back (as SGLang)."""
        return bool(self.released_tags)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config,
                    self.tokenizer):
            v = getattr(src, "eos_token_id", None) if src is not None else None
            ids.update([v] if is_int(v) else (v or []))
        return {i for i in ids if 0 <= i < self.vocab_size}

    # -- thread-facing API (any thread) --------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self.inbox.put(("stop", None))
        if self.thread.is_alive():
            self.thread.join(timeout=timeout_s)
        if self.shared is not None:
            self.shared.close()

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
        if self.threads:
            torch.set_num_threads(self.threads)
        while True:
            busy = bool(self.batch or self.pending) and not self.held
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
                    # False: the caller gave up (timeout, client gone) before it started; a
                    # cancelled future would also make set_result raise on this thread
                    if not fut.set_running_or_notify_cancel():
                        continue
                    try:
                        self.answers.append((fut, fn(), None))
                    except BaseException as e:  # the caller gets it; the engine goes on
                        self.answers.append((fut, None, e))
                    self._send_answers()  # after the answers it gave (an abort's), in order
            self._send_answers()
            if self.held:
                continue
            t0 = time.perf_counter()
            try:
                self.step()
            except Exception as e:  # _admit/_decode isolate request failures; this is a bug
                log.exception("embedded engine step failed")
                self._fail_all(e)
            self.busy_seconds += time.perf_counter() - t0

    def step(self) -> None:
        """One scheduler step (the scheduler thread's, or a test's on its own thread): admit
        what waits while there is room, decode a token for every running request, then
        answer the requests that finished."""
        try:
            if self.pending and len(self.batch) < self.max_batch_size:
                self._admit()
            if self.batch:
                self._decode()
        finally:
            self._send_answers()

    def _send_answers(self) -> None:
        answers, self.answers = self.answers, []
        for fut, result, error in answers:
            if fut.done():  # the caller cancelled it meanwhile
                continue
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

    def _fail_all(self, e: BaseException) -> None:
        self._send_answers()  # the requests that finished before keep their results
        for s in [*self.admitting, *self.batch, *self.pending]:
            self.rids.discard(s.rid)
            if not s.future.done():
                s.future.set_exception(e)
        self.batch, self.pending = [], collections.deque()
        self._drop_kv()
        self.admitting = []

    def _fail(self, s: Seq, e: BaseException) -> None:
        """One request failed: it alone gets the error (its row leaves at the next retire)."""
        log.warning("embedded engine: request %s failed: %s: %s", s.rid, type(e).__name__, e)
        s.finish = {"type": "error"}
        self.rids.discard(s.rid)
        self.answers.append((s.future, None, e))

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor,
                 cache: Any, routed: bool, bias: torch.Tensor | None = None,
                 decode: bool = False) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
        """`decode`: one new token per row on a cache that holds the rows (`lean_decode`'s
        step may run it); a prefill, one token long or not, runs the model's forward."""
        # router logits come from hooks on the routers, not `output_router_logits`: that also
        # computes the load-balancing loss, whose attention-mask shapes break on KV-cached
        # steps of more than one row
        logits: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(
            lambda _m, _a, o, i=i: logits.append(o[i] if isinstance(o, (tuple, list)) else o))
            for m, i in (self.routers if routed else [])]
        extra = {} if bias is None else {"position_bias": bias}  # see `attention_mode`
        try:
            # inference mode: less dispatch work per op than no_grad (the tiny models' steps
            # are mostly per-op overhead). Its tensors (logits, a prefill's cache, a grown
            # slab) are only read outside it: merge and retire copy them
            with torch.inference_mode(self.inference_mode):
                if decode and self.decode_step is not None:
                    last = self.decode_step(ids, pos, cache, attention_mask=mask,
                                            **extra)  # writes cache
                else:
                    out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                     past_key_values=cache, use_cache=True, logits_to_keep=1,
                                     **extra)
                    last, cache = out.logits[:, -1, :], out.past_key_values
        finally:
            for h in hooks:
                h.remove()
        experts = None
        if routed:  # per layer [B*L, E] → [B, L, layers, top_k]
            b, n = ids.shape
            experts = torch.stack([torch.topk(r.view(b, n, -1), self.top_k_experts, dim=-1)
                                   .indices for r in logits], dim=2)
        return last.float(), cache, experts

    def _admit(self) -> None:
        group = self.admitting = []
        while self.pending and len(self.batch) + len(group) < self.max_batch_size:
            group.append(self.pending.popleft())
        try:
            self._prefill(group)
        except Exception as e:
            self._alone(group, e, "prefill")
        finally:
            self.admitting = []

    def _alone(self, seqs: list[Seq], e: Exception, step: str) -> None:
        """A batched step failed: prefill each request on its own (from prompt + output so
        far, as after a retract), so only a request that fails alone gets the error."""
        seqs = [s for s in seqs if s.finish is None]
        if len(seqs) == 1 and step == "prefill":
            self._fail(seqs[0], e)
            return
        log.warning("embedded engine: %s of %d requests failed (%s: %s); running them one by "
                    "one", step, len(seqs), type(e).__name__, e)
        for s in seqs:
            try:
                self._prefill([s])
            except Exception as e1:
                self._fail(s, e1)

    def _prefill(self, group: list[Seq]) -> None:
        # a retracted request comes back with its output so far: prefill prompt + output
        toks = [s.prompt + s.out for s in group]
        # each row runs after its longest cached prefix (its last turn, a shared opening), and
        # rows of similar suffix lengths share a pass whatever their prefixes: an agent's
        # turns each extend their own cache entry, and a pass per entry cost 4 passes per
        # admission in the partial-rollout benchmark. All passes run before any row joins the
        # batch: a failure leaves the running batch as it was (the caller then retries the
        # rows one by one).
        keys, kvs = [], []
        for t, s in zip(toks, group, strict=True):
            key = self._prefix_of(t, s)
            keys.append(key)  # its KV taken now: a later row's new prefix may evict it
            kvs.append(self.prefixes.get(key) if key else None)
        parts = []
        for bucket in prefill_buckets([len(t) - len(k) for t, k in zip(toks, keys, strict=True)],
                                      self.prefill_call_tokens):
            parts.append(self._prefill_rows([group[i] for i in bucket], [toks[i] for i in bucket],
                                            [len(keys[i]) for i in bucket],
                                            [kvs[i] for i in bucket]))
        self._merge(parts)

    def _prefix_of(self, toks: list[int], s: Seq) -> tuple[int, ...]:
        """The cached prefix this prompt runs after (caching a new one first where the plan
        says so); () for none. Not for rows that report routed experts (per token, prompt
        included)."""
        if self.prefixes is None or s.return_routed or self.attention != "bias":
            return ()
        have, new = self.prefixes.plan(toks)
        if new:
            self.prefixes.tokens_computed += len(new) - len(have)
            if self.prefixes.add(new, self._prefix_kv(new, have)):
                return new
        return have

    def _prefix_kv(self, key: tuple[int, ...], base: tuple[int, ...]) -> list[tuple[Any, Any]]:
        """Per layer the (keys, values) [1, heads, len(key), dim] of `key`, run after the
        cached `base`."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if base:
            for li, (k, v) in enumerate(self.prefixes.kv(base)):
                cache.update(k, v, li)
        ids = torch.tensor([key[len(base):]])
        pos = torch.arange(len(base), len(key))[None]
        _, cache, _ = self._forward(ids, None, pos, cache, False)
        return [(layer.keys, layer.values) for layer in cache.layers]

    def _prefill_rows(self, seqs: list[Seq], toks: list[list[int]], cached: list[int],
                      kvs: list[Any]) -> _Part:
        """One prefill pass over rows whose first `cached[i]` tokens have the keys and values
        `kvs[i]` (a cached prefix, or None for none): the pass holds each row as [padding,
        prefix, padding, suffix] and moves the padding first. Samples each row's next token;
        returns the rows' cache, right-aligned after left padding, for `_merge`."""
        from transformers import DynamicCache

        sufs = [t[c:] for t, c in zip(toks, cached, strict=True)]
        width, front_cols = max(len(t) for t in sufs), max(cached)
        pad = torch.tensor([width - len(t) for t in sufs])
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, t in enumerate(sufs):
            ids[i, width - len(t):] = torch.tensor(t)
        pos = (torch.arange(width) - pad[:, None]).clamp(min=0) + torch.tensor(cached)[:, None]
        # the model's own layer kinds: Qwen3.5's Gated DeltaNet layers keep recurrent states
        cache = DynamicCache(config=self.model.config)
        front = torch.tensor([front_cols - c for c in cached])  # each row's prefix padding
        if not front_cols:
            mask, bias = self._masks(pad, width, prefill=True)
        else:
            cache.layers = _prefix_slabs(kvs, front_cols, front_cols + width)
            mask, bias = None, (pad_bias(pad, width, self.dtype, skip=front_cols, front=front)
                                if bool(pad.any() or front.any()) else None)
        routed = any(s.return_routed for s in seqs)
        self.stepping = seqs
        logits, cache, experts = self._forward(ids, mask, pos, cache, routed, bias)
        if front_cols and bool(pad.any()):
            with torch.inference_mode(self.inference_mode):  # the pass's tensors, in place
                _padding_first(cache, pad, front, front_cols)
        if experts is not None:
            for i, s in enumerate(seqs):
                s.routed = list(experts[i, width - len(sufs[i]):].numpy().astype(np.int32))
        self._sample(seqs, logits)
        keep = [i for i, s in enumerate(seqs) if s.finish is None]
        return [seqs[i] for i in keep], keep, cache, pad + front, front_cols + width

    def _masks(self, pad: torch.Tensor, cols: int, prefill: bool
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(attention_mask, position_bias) for rows whose first `pad` of `cols` columns are
        padding: neither without padding (the model's own causal path, no mask built)."""
        if not bool(pad.any()):
            return None, None
        if self.attention == "bias":
            return None, pad_bias(pad, cols, self.dtype)
        if self.attention == "mask4d" and not prefill:
            return pad_bias(pad, cols, self.dtype), None
        return (torch.arange(cols) >= pad[:, None]).long(), None

    def _step_masks(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`_masks` for a decode step, from a bias kept across steps (rebuilt only when rows
        join or leave): the new column is never padding."""
        cols = self.width + 1
        if not self.padded:
            return None, None
        if self.attention == "mask2d":
            return self._masks(self.pad, cols, prefill=False)
        if self.step_bias is None or self.step_bias.shape[-1] < cols:
            self.step_bias = pad_bias(self.pad, cols + SLAB_SPARE, self.dtype)
        bias = self.step_bias[..., :cols]
        return (None, bias) if self.attention == "bias" else (bias, None)

    def _decode(self) -> None:
        batch = self.batch
        try:
            ids = torch.tensor([[s.out[-1]] for s in batch])
            pos = (self.width - self.pad)[:, None]
            mask, bias = self._step_masks()
            routed = any(s.return_routed for s in batch)
            self.stepping = batch
            # the cache is written in place (SlabLayer)
            logits, _, experts = self._forward(ids, mask, pos, self.cache, routed, bias,
                                               decode=True)
            self.width += 1
            if experts is not None:
                for i, s in enumerate(batch):
                    s.routed.append(experts[i, 0].numpy().astype(np.int32))
            self._sample(batch, logits)
            self._retire()
        except Exception as e:
            # the KV cache may be half-updated: drop it and re-prefill the rows one by one
            self.batch = []
            self._drop_kv()
            self._alone(batch, e, "decode")

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        # rows with no token to ban, greedy or sampled, in one batch: the softmaxes, sorts and
        # top-k/top-p masks of all of them at once, and per sampled row only its own draw
        # (row by row it is ~10 tensor calls per row and step: at 16 rows, more time than the
        # tiny models' attention takes). The same tokens and log-probs as `_sample_row`.
        fast = [i for i, s in enumerate(seqs) if not self._banned(s, logits.shape[-1])]
        picked: dict[int, tuple[int, float]] = {}
        if fast:
            try:
                rows = logits if len(fast) == len(seqs) else logits[fast]
                toks, lps = self._pick([seqs[i] for i in fast], rows)
                picked = dict(zip(fast, zip(toks, lps, strict=True), strict=True))
            except Exception:  # row by row below: a failure is then its request's own
                picked = {}
        for i, s in enumerate(seqs):
            try:
                if i in picked:
                    self._emit(s, *picked[i])
                else:
                    self._sample_row(s, logits[i])
            except Exception as e:  # this request's own failure: the others go on
                self._fail(s, e)

    def _pick(self, seqs: list[Seq], rows: torch.Tensor) -> tuple[list[int], list[float]]:
        """`_sample_row` for rows with no banned token, batched: greedy rows take the argmax,
        sampled ones draw from their own generators as `_draw` does."""
        sps = [s.sampling for s in seqs]
        drawn = [j for j, sp in enumerate(sps) if not sp.greedy]
        toks = rows.argmax(-1)
        if not drawn:
            return toks.tolist(), _gathered(torch.log_softmax(rows, -1), toks)
        temp = torch.tensor([1.0 if sp.greedy else sp.temperature for sp in sps])[:, None]
        scaled = rows / temp  # greedy rows: / 1.0, unchanged
        sub = scaled if len(drawn) == len(sps) else scaled[drawn]
        toks = toks.clone()
        toks[drawn] = draw_tokens(torch.softmax(sub, -1), [sps[j] for j in drawn],
                                  [self._generator(seqs[j]) for j in drawn])
        lp_source = rows if self.return_original_logprob else scaled
        return toks.tolist(), _gathered(torch.log_softmax(lp_source, -1), toks)

    def _banned(self, s: Seq, vocab: int) -> list[int]:
        """The tokens SGLang's min_new_tokens penalizer bans now: stop tokens and EOS (never
        every token)."""
        sp = s.sampling
        if len(s.out) >= sp.min_new_tokens or not (
                sp.stop_token_ids or (self.eos_ids and not sp.ignore_eos)):
            return []
        banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_ids)
        return list(banned) if len(banned) < vocab else []

    def _sample_row(self, s: Seq, row: torch.Tensor) -> None:
        sp = s.sampling
        banned = self._banned(s, len(row))
        if banned:
            row = row.clone()
            row[banned] = float("-inf")
        if sp.greedy:
            tok = int(torch.argmax(row))
            scaled = row
        else:
            scaled = row / sp.temperature
            tok = self._draw(scaled, sp, s)
        lp_source = row if self.return_original_logprob else scaled
        self._emit(s, tok, float(torch.log_softmax(lp_source, -1)[tok]))

    def _emit(self, s: Seq, tok: int, logprob: float) -> None:
        sp = s.sampling
        s.out.append(tok)
        s.logprobs.append(logprob)
        s.versions.append(self.weight_version)
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_ids):
            self._finish(s, {"type": "stop", "matched": tok})
        elif len(s.out) >= sp.max_new_tokens or len(s.prompt) + len(s.out) >= (
                self.context_length):
            self._finish(s, {"type": "length", "length": len(s.out)})

    @staticmethod
    def _generator(s: Seq) -> torch.Generator:
        if s.generator is None:
            seed = s.sampling.seed
            s.generator = torch.Generator().manual_seed(
                seed if seed is not None else secrets.randbits(63))
        return s.generator

    def _draw(self, scaled: torch.Tensor, sp: Sampling, s: Seq) -> int:
        return int(draw_tokens(torch.softmax(scaled, -1)[None], [sp], [self._generator(s)])[0])

    def _merge(self, parts: list[_Part]) -> None:
        """Add prefilled rows to the running batch: one new slab per attention layer holding
        the running rows and the new ones, all right-aligned at the widest width, with spare
        columns for the decode steps ahead (one copy per admission, none per step)."""
        # (cache, its rows to take or None for all, their padding, first column, width)
        srcs = [(cache, torch.tensor(keep), pad[keep], 0, width)
                for _, keep, cache, pad, width in parts if keep]
        if not srcs:
            return
        if self.batch:  # the running rows, without the left columns none of them uses
            start = int(self.pad.min())
            srcs.insert(0, (self.cache, None, self.pad - start, start, self.width - start))
        seqs = self.batch + [s for part in parts for s in part[0]]
        width = max(w for *_, w in srcs)
        cap = width + self._headroom(seqs)
        base = srcs[0][0]
        # computed before anything is assigned: a failure leaves the running batch intact;
        # a recurrent layer's states have no time axis: rows are only stacked
        merged = [_stacked_states([(c.layers[li], idx) for c, idx, *_ in srcs])
                  if _is_recurrent(layer) else
                  _slab_of([(c.layers[li], idx, a, w) for c, idx, _, a, w in srcs], width, cap)
                  for li, layer in enumerate(base.layers)]
        pad = torch.cat([p + (width - w) for _, _, p, _, w in srcs])
        for li, m in enumerate(merged):
            if isinstance(m, tuple):
                base.layers[li].conv_states, base.layers[li].recurrent_states = m
            else:
                base.layers[li] = m
        self.batch, self.cache = seqs, base
        self._set_pad(pad, width)
        self.max_running = max(self.max_running, len(self.batch))

    def _headroom(self, seqs: list[Seq]) -> int:
        """Spare slab columns: what the longest-running row may still decode, at most
        SLAB_SPARE (a slab that runs out grows)."""
        need = max(min(s.sampling.max_new_tokens, self.context_length - len(s.prompt))
                   - len(s.out) for s in seqs)
        return max(1, min(need, SLAB_SPARE))

    def _retire(self) -> None:
        """Drop finished rows: the last running rows move into their slots and the cache
        keeps its storage, a copy of the moved rows alone (compacting the cache copied every
        row, 12 % of an eval's engine time). The left columns no remaining row uses are
        dropped at the next merge, which copies the cache anyway."""
        n = sum(s.finish is None for s in self.batch)
        if n == len(self.batch):
            return
        if self.prefixes is not None:
            self._keep_finished()
        if not n:
            self.batch = []
            self._drop_kv()
            return
        holes = [i for i in range(n) if self.batch[i].finish is not None]
        movers = [i for i in range(n, len(self.batch)) if self.batch[i].finish is None]
        order = list(range(n))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        dst, src = torch.tensor(holes, dtype=torch.long), torch.tensor(movers, dtype=torch.long)
        # a grown slab or a prefill's states are inference tensors: changed in that mode only
        with torch.inference_mode(self.inference_mode):
            for layer in self.cache.layers:
                if _is_recurrent(layer):
                    _map_states(layer, lambda x: _moved(x, dst, src, n))
                else:
                    layer.keep_rows(dst, src, n)
        self.batch = [self.batch[i] for i in order]
        self._set_pad(self.pad[torch.tensor(order)], self.width)

    def _keep_finished(self) -> None:
        """The KV of requests that finished (prompt and output, but the last token, which no
        step has fed yet) as cached prefixes: an agent's next turn extends them."""
        pads = self.pad.tolist()  # one call, not one a finished row
        for i, s in enumerate(self.batch):
            if s.finish is None or s.finish.get("type") == "error" or s.return_routed:
                continue
            n = self.width - pads[i]
            toks = (s.prompt + s.out)[:n]
            if n < self.prefixes.min_tokens or len(toks) != n:
                continue
            self.prefixes.add(tuple(toks), [
                (layer.keys[i:i + 1, :, self.width - n:].clone(),
                 layer.values[i:i + 1, :, self.width - n:].clone())
                for layer in self.cache.layers], finished=True)

    def _set_pad(self, pad: torch.Tensor, width: int) -> None:
        self.pad, self.width, self.padded = pad, width, bool(pad.any())
        self.step_bias = None

    def _drop_kv(self) -> None:
        self.cache, self.pad, self.width, self.padded, self.step_bias = None, None, 0, False, None

    def _finish(self, s: Seq, reason: dict[str, Any]) -> None:
        s.finish = reason
        self.rids.discard(s.rid)
        if s.future.done():
            return
        try:
            self.answers.append((s.future, self._response(s), None))
        except Exception as e:  # e.g. the tokenizer cannot decode this request's output
            log.warning("embedded engine: response for %s failed: %s", s.rid, e)
            self.answers.append((s.future, None, e))

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
            self.batch = []
            self._drop_kv()
        elif mode != "in_place":
            raise BadRequest(f"mode: expected 'abort', 'retract' or 'in_place', got {show(mode)}")
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    @staticmethod
    def _check_version(version: Any) -> None:
        # SGLang's versions are strings; the protocol's are integers, sent as str(int)
        ok = is_int(version) or (isinstance(version, str) and len(version) <= 32)
        try:
            ok = ok and int(version) is not None
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise BadRequest(f"weight_version: expected an integer string, got {show(version)}")

    def set_version(self, version: Any) -> None:
        if version is not None:
            self._check_version(version)
            self.weight_version = str(version)

    def load_weights(self, named: list[tuple[str, torch.Tensor]], version: Any,
                     require_complete: bool = False) -> None:
        if "weights" in self.released_tags:  # SGLang's weights would be unmapped memory
            raise BadRequest("weights are released: resume them first "
                             "(/resume_memory_occupation with tags ['weights'])", 503)
        if version is not None:
            self._check_version(version)  # before any weight is written
        if any(n.endswith(SCALE_SUFFIX) or t.dtype == FP8_DTYPE for n, t in named):
            # an FP8 update (weight + weight_scale_inv): this engine keeps its own dtype
            try:
                named = dequantize_named(named)
            except ValueError as e:
                raise BadRequest(str(e)) from None
        self.weights.validate(named)
        if require_complete:
            gaps = self.weights.coverage_gaps([n for n, _ in named])
            if gaps:
                raise BadRequest(f"checkpoint leaves {len(gaps)} weights unset, e.g. "
                                 f"'{gaps[0]}'")
        self.weights.load(named)
        self._weights_changed()
        self.set_version(version)
        self.control_log.append(("load_weights", tuple(sorted(self.released_tags))))

    def _weights_changed(self) -> None:
        head = getattr(self.model, "lm_head", None)
        if isinstance(head, TransposedOutputLayer):  # this engine's, or another's on the model
            head.refresh()
        if self.prefixes is not None:  # their keys and values came from the old weights
            self.prefixes.clear()

    def flush_cache(self) -> None:
        """SGLang's /flush_cache: drop the cached prefixes and the prompts they came from."""
        if self.prefixes is not None:
            self.prefixes.clear()

    def share_weights(self) -> dict[str, Any]:
        """Move the parameters into shared memory (once) and return its layout, so a trainer on
        this machine writes updates straight into them (engines/shared_weights.py)."""
        if self.shared is None:
            self.shared = SharedWeightStore(self.model, self.weights.map)
        return self.shared.layout()

    @contextlib.contextmanager
    def weights_held(self, version: Any, timeout_s: float = 120.0) -> Iterator[str]:
        """From any thread but the scheduler's: no step runs in the block, whose writer
        writes the shared parameters in place, and `version` is committed when it ends: the
        begin / commit of `/shared_weights/*` for the engine's own process (no HTTP round
        trips). A block that raises leaves the engine held: half-written weights never
        decode; the next window recovers it. Yields the shared memory's label."""
        label = self.call(self.begin_weight_write).result(timeout_s)
        yield label
        self.call(lambda: self.commit_weight_write(version)).result(timeout_s)

    def begin_weight_write(self) -> str:
        """Hold every step until `commit_weight_write`: requests stay in flight, none decodes
        with half-written weights. Returns the shared memory's label (a writer holding another
        one maps the memory of an engine that has since restarted, which shares its weights
        here if it did not yet)."""
        if "weights" in self.released_tags:
            raise BadRequest("weights are released: resume them first "
                             "(/resume_memory_occupation with tags ['weights'])", 503)
        if self.shared is None:
            self.share_weights()
        self.writing = True
        return self.shared.memory.label

    def commit_weight_write(self, version: Any) -> None:
        if not self.writing:
            raise BadRequest("no shared-weights write is open: POST /shared_weights/begin first")
        if version is not None:
            self._check_version(version)
        self._weights_changed()
        self.set_version(version)
        self.writing = False
        self.control_log.append(("load_weights", tuple(sorted(self.released_tags))))

    def release(self, tags: Any = None) -> None:
        regions = memory_tags(tags)
        if self.batch and "kv_cache" in regions | self.released_tags:
            raise BadRequest(f"cannot release memory with {len(self.batch)} requests decoding; "
                             "pause generation (retract or abort) first")
        self.released_tags |= regions
        self.control_log.append(("release", tuple(sorted(regions))))

    def resume_memory(self, tags: Any = None) -> None:
        regions = memory_tags(tags)
        self.released_tags -= regions
        self.control_log.append(("resume", tuple(sorted(regions))))

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

    def info(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "paused": self.paused,
                "writing_shared_weights": self.writing,
                "released": self.released, "released_tags": sorted(self.released_tags),
                "weight_bytes": self.weight_bytes(), "max_batch_size": self.max_batch_size,
                "running": {s.rid: len(s.out) for s in self.batch},
                "max_running": self.max_running,
                "waiting": [s.rid for s in self.pending],
                "prefix_cache": self.prefixes.info() if self.prefixes is not None else None,
                "return_original_logprob": self.return_original_logprob,
                "context_length": self.context_length}


def draw_tokens(probs: torch.Tensor, sampling: list[Sampling],
                generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` [n, vocab], from one uniform of the row's own generator by
    inverse CDF. Rows with top-k or top-p are sorted and truncated first (top-p keeps the
    smallest prefix whose mass reaches top_p, the first token always); the others draw in
    vocabulary order, without the sort: at a 34k vocabulary a sort of every row and a
    multinomial per row took 2/3 of a sampled decode step."""
    n, vocab = probs.shape
    u = torch.cat([torch.rand(1, generator=g) for g in generators])
    toks = torch.empty(n, dtype=torch.long)
    top_ks = [sp.top_k if 0 < sp.top_k < vocab else vocab for sp in sampling]  # -1: all
    cut = [r for r, sp in enumerate(sampling) if top_ks[r] < vocab or sp.top_p < 1.0]
    free = sorted(set(range(n)) - set(cut))
    if free:
        toks[free] = _inverse_cdf(probs if len(free) == n else probs[free], u[free])
    if cut:
        sorted_p, order = torch.sort(probs[cut], -1, descending=True)
        top_k = torch.tensor([top_ks[r] for r in cut])[:, None]
        top_p = torch.tensor([sampling[r].top_p for r in cut])[:, None]
        keep = (torch.arange(vocab) < top_k) & ((torch.cumsum(sorted_p, -1) - sorted_p) < top_p)
        keep[:, 0] = True  # a top_p below float32's smallest (1e-97 arrives as 0.0) keeps it too
        sorted_p = torch.where(keep, sorted_p, torch.zeros(()))
        toks[cut] = order.gather(-1, _inverse_cdf(sorted_p, u[cut])[:, None])[:, 0]
    return toks


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row the first index whose cumulative weight exceeds u x the row's total: never a
    token of weight 0 (its cumulative weight equals its predecessor's)."""
    cdf = torch.cumsum(weights, -1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    idx.clamp_(max=weights.shape[-1] - 1)
    # u x total may round up to the total: the row's last token with weight then
    for r in (weights.gather(-1, idx[:, None])[:, 0] <= 0).nonzero()[:, 0].tolist():
        idx[r] = (weights[r] > 0).nonzero()[-1, 0]
    return idx


def _gathered(logprobs: torch.Tensor, toks: torch.Tensor) -> list[float]:
    """Each row's log-prob of its token."""
    return logprobs.gather(-1, toks[:, None])[:, 0].tolist()


def _is_recurrent(layer: Any) -> bool:
    """A linear-attention (Gated DeltaNet) cache layer: conv and recurrent states per row."""
    return hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states")


def _map_states(layer: Any, fn: Any) -> None:
    for states in (layer.conv_states, layer.recurrent_states):
        for i, x in states.items():
            if x is not None:
                states[i] = fn(x)


def _moved(x: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, n: int) -> torch.Tensor:
    """Rows `src` of a recurrent state copied into rows `dst`; the first `n` rows."""
    x[dst] = x[src]
    return x[:n]


def _stacked_states(parts: list[tuple[Any, torch.Tensor | None]]) -> tuple[dict, dict]:
    """Recurrent layers' states with the rows of every part stacked (batch axis first); a part
    is (layer, its rows to take or None for all)."""
    def rows(x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
        return x if idx is None else x[idx]

    first = parts[0][0]
    return tuple({i: torch.cat([rows(getattr(layer, kind)[i], idx) for layer, idx in parts], 0)
                  if v is not None else None for i, v in getattr(first, kind).items()}
                 for kind in ("conv_states", "recurrent_states"))


def _slab_of(parts: list[tuple[Any, torch.Tensor | None, int, int]], width: int, cap: int
             ) -> Any:
    """A SlabLayer of `cap` columns holding every part's rows right-aligned at `width`; a part
    is (attention cache layer, its rows to take or None for all, its first column, its
    width)."""
    rows = sum(len(layer.keys) if idx is None else len(idx) for layer, idx, *_ in parts)
    k0, v0 = parts[0][0].keys, parts[0][0].values
    keys = k0.new_empty(rows, k0.shape[1], cap, k0.shape[3])
    values = v0.new_empty(rows, v0.shape[1], cap, v0.shape[3])
    r = 0
    for layer, idx, start, w in parts:
        k, v = layer.keys[:, :, start:start + w], layer.values[:, :, start:start + w]
        if idx is not None:
            k, v = k[idx], v[idx]
        n, shift = len(k), width - w
        # columns left of a shorter part: masked, never attended, but must be finite (0 * NaN)
        keys[r:r + n, :, :shift].zero_()
        values[r:r + n, :, :shift].zero_()
        keys[r:r + n, :, shift:width] = k
        values[r:r + n, :, shift:width] = v
        r += n
    return _slab_layer()(keys, values, width)


@functools.cache
def _slab_layer() -> type:
    from transformers.cache_utils import DynamicLayer

    class SlabLayer(DynamicLayer):
        """A full-attention layer's KV cache in buffers with spare columns: a step writes its
        keys and values in place and attention reads a view of the columns used (transformers'
        DynamicLayer concatenates: a copy of the whole cache at every step)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
            super().__init__()
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
            self.kbuf, self.vbuf = keys, values
            self._view(length)

        def _view(self, n: int) -> None:
            self.keys, self.values = self.kbuf[:, :, :n], self.vbuf[:, :, :n]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            t, n = self.keys.shape[-2], key_states.shape[-2]
            if t + n > self.kbuf.shape[-2]:  # out of spare columns: about twice the room
                self.kbuf, self.vbuf = (_grown(x, t, t + n + max(t, SLAB_SPARE))
                                        for x in (self.kbuf, self.vbuf))
            self.kbuf[:, :, t:t + n] = key_states
            self.vbuf[:, :, t:t + n] = value_states
            self._view(t + n)
            return self.keys, self.values

        def keep_rows(self, dst: torch.Tensor, src: torch.Tensor, n: int) -> None:
            """Rows `src` copied into rows `dst`, then the first `n` rows kept (a view)."""
            used = self.keys.shape[-2]
            for buf in (self.kbuf, self.vbuf):
                buf[dst, :, :used] = buf[src, :, :used]
            self.kbuf, self.vbuf = self.kbuf[:n], self.vbuf[:n]
            self._view(used)

    return SlabLayer


def _grown(x: torch.Tensor, used: int, cap: int) -> torch.Tensor:
    out = x.new_empty(*x.shape[:2], cap, x.shape[3])
    out[:, :, :used] = x[:, :, :used]
    return out


def _prefix_slabs(kvs: list[Any], cached: int, cols: int) -> list[Any]:
    """Per attention layer a slab of `cols` columns holding each row's cached prefix (a
    per-layer list of (keys, values) [1, heads, len, dim], or None) right-aligned at column
    `cached`, zeros before it: a prefill pass writes the rows' new tokens after it."""
    first = next(kv for kv in kvs if kv is not None)
    k0, v0 = first[0]
    layers = []
    for li in range(len(first)):
        keys = k0.new_zeros(len(kvs), k0.shape[1], cols, k0.shape[3])
        values = v0.new_zeros(len(kvs), v0.shape[1], cols, v0.shape[3])
        for i, kv in enumerate(kvs):
            if kv is not None:
                k, v = kv[li]
                keys[i, :, cached - k.shape[2]:cached] = k[0]
                values[i, :, cached - v.shape[2]:cached] = v[0]
        layers.append(_slab_layer()(keys, values, cached))
    return layers


def _padding_first(cache: Any, pad: torch.Tensor, front: torch.Tensor, cached: int) -> None:
    """A pass run after cached prefixes holds each row as [front padding, prefix, padding,
    suffix], the prefixes ending at column `cached`: move the padding columns first, as every
    other pass leaves its rows (keys carry their positions: the order of the columns is the
    mask's business only). Each padded row's prefix moves right by its padding, in place; the
    columns it leaves keep finite values, which the mask hides (a gather of every column of
    every row and layer took ~5 ms a pass on the tiny agent model, here < 1)."""
    for i in pad.nonzero()[:, 0].tolist():
        f, p = int(front[i]), int(pad[i])
        for layer in cache.layers:
            for t in (layer.keys, layer.values):
                t[i, :, f + p:cached + p] = t[i, :, f:cached].clone()


def plain_attention_cache(model: torch.nn.Module) -> bool:
    """Every layer of the model's cache is transformers' plain full-attention layer (no
    sliding window, no recurrent state): the ones a cached prefix can be put in front of."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer
               for layer in DynamicCache(config=model.config).layers)


def prefill_buckets(lengths: list[int], call_tokens: int) -> list[list[int]]:
    """Rows (indices into `lengths`) grouped into prefill passes, by length: the grouping that
    minimises the sum over passes of `call_tokens + rows * width` (padding included), so a cut
    is made where the padding it saves outweighs one more forward pass, costed as `call_tokens`
    tokens. Dynamic programming over the sorted lengths; ties keep fewer passes."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best, cut = [0.0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        width = lengths[order[j - 1]]
        for i in range(j):
            cost = best[i] + call_tokens + (j - i) * width
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def attention_mode(model: torch.nn.Module) -> str:
    """How the engine tells the model's attention which cache columns are padding.

    "bias": transformers' sdpa takes an additive `position_bias` (meant for relative position
    biases) and still runs torch's grouped-query kernel; with an `attention_mask` instead it
    first repeats the KV heads (a copy of the whole cache per layer per step) and builds the
    mask per step. Attention-only models: a recurrent layer's kernels would be passed the
    bias too. "mask4d": decode steps pass the same bias as a prepared 4D mask (transformers
    uses it as is: nothing built per step); prefill passes a 2D mask, which Gated DeltaNet
    layers need to zero their padding. "mask2d": other attention kernels (flash attention)."""
    from transformers import DynamicCache

    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return "mask2d"
    recurrent = any(_is_recurrent(layer) for layer in DynamicCache(config=model.config).layers)
    return "bias" if impl == "sdpa" and not recurrent and _sdpa_takes_bias() else "mask4d"


class FusedRMSNorm(torch.nn.Module):
    """An RMSNorm as one op (`torch.nn.functional.rms_norm`, what the trainer's specs run),
    holding the Parameter of the module it replaces: same name, same values, same storage.
    `offset` 1.0: a zero-centred gamma (Qwen3.5's 1 + w)."""

    def __init__(self, weight: torch.nn.Parameter, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight, self.eps, self.offset = weight, eps, offset
        self.variance_epsilon = eps  # HF Qwen3's name for it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = self.weight + self.offset if self.offset else self.weight
        return torch.nn.functional.rms_norm(x, gamma.shape, gamma, self.eps)


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Swap each RMSNorm whose output the fused op reproduces bit for bit (probed on a copy
    with random weights, in the model's dtype) for a `FusedRMSNorm`; returns how many. HF's
    norm is five ops (to fp32, pow, mean, rsqrt, two muls): at a decode step's 16 rows their
    dispatch costs more than the math. A norm of any other formula stays as it is."""
    import copy

    offsets: dict[type, float | None] = {}  # per class: the fused form that matched, if any
    swapped = 0
    for parent in list(model.modules()):
        for name, m in list(parent.named_children()):
            w = getattr(m, "weight", None)
            eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
            if (isinstance(m, FusedRMSNorm) or not type(m).__name__.endswith("RMSNorm")
                    or not isinstance(w, torch.nn.Parameter)
                    or w.dim() != 1 or not isinstance(eps, float) or list(m.children())):
                continue
            if type(m) not in offsets:
                offsets[type(m)] = next((o for o in (0.0, 1.0)
                                         if _fuses_exactly(copy.deepcopy(m), eps, o)), None)
            if offsets[type(m)] is not None:
                setattr(parent, name, FusedRMSNorm(w, eps, offsets[type(m)]))
                swapped += 1
    return swapped


def _fuses_exactly(probe: torch.nn.Module, eps: float, offset: float) -> bool:
    gen = torch.Generator().manual_seed(0)
    w = probe.weight
    with torch.no_grad():
        w.copy_(torch.randn(w.shape, generator=gen).to(w.dtype))
        fused = FusedRMSNorm(w, eps, offset)
        for scale in (1e-3, 1.0, 1e3):
            x = (torch.randn(3, 5, w.shape[0], generator=gen) * scale).to(w.dtype)
            try:
                if not torch.equal(probe(x), fused(x)):
                    return False
            except Exception:  # a norm with another signature: leave it as it is
                return False
    return True


def keeps_no_state(model: torch.nn.Module) -> bool:
    """The model's forward writes no module state: dynamic and long RoPE re-register their
    frequencies as the positions grow, which inference mode would leave as inference tensors
    (unusable by autograd afterwards)."""
    for m in model.modules():
        kinds = getattr(m, "rope_type", None)
        for kind in kinds.values() if isinstance(kinds, dict) else [kinds]:
            if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope"):
                return False
    return True


def _sdpa_takes_bias() -> bool:
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return (ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
                and "position_bias" in inspect.signature(sdpa_attention_forward).parameters)
    except Exception:  # another transformers: the generic path
        return False
