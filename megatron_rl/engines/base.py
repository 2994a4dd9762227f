"""The rollout-engine protocol: what a scheduler and a trainer may ask of an inference server.

One protocol for SGLang servers and the embedded CPU server; both are driven over SGLang's HTTP
API by `HttpEngine`. Requests carry their id (`rid`) so in-flight ones can be aborted; an
aborted request returns what it generated so far with finish_reason "abort", so a scheduler can
resume it later from that committed prefix. Each generated token records the weight version
that produced it, so a trainer can tell on-policy tokens from stale ones after an update.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract", "in_place"]

# The shared secret of an engine's control plane (docs/engines.md, "Exposure"): read from the
# environment only, never a flag or a config field, so it shows in no `ps` and no log.
TOKEN_ENV = "MEGATRON_RL_ENGINE_TOKEN"
MIN_TOKEN_CHARS = 16
# routes that change an engine's state: they need the token (as `Authorization: Bearer`)
CONTROL_ROUTES = frozenset({
    "/abort_request", "/pause_generation", "/continue_generation",
    "/update_weights_from_tensor", "/update_weights_from_disk", "/update_weight_version",
    "/init_weights_update_group", "/update_weights_from_distributed",
    "/destroy_weights_update_group", "/release_memory_occupation", "/resume_memory_occupation",
    "/flush_cache", "/shared_weights", "/shared_weights/begin", "/shared_weights/commit"})


# SGLang 0.5.23's memory regions (srt/constants.py GPU_MEMORY_TYPE_*), the `tags` of
# /release_memory_occupation and /resume_memory_occupation
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


def engine_token() -> str | None:
    """The control-plane token from `MEGATRON_RL_ENGINE_TOKEN` (None when unset or empty)."""
    return os.environ.get(TOKEN_ENV, "").strip() or None


def is_loopback_host(host: str) -> bool:
    """Whether binding `host` keeps a server on this machine ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


@dataclass
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy; top_k -1 = off; seed None = unseeded."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (off) or >= 1")
        if self.max_new_tokens < 0 or self.min_new_tokens < 0:
            raise ValueError("max_new_tokens and min_new_tokens must be >= 0")

    def to_sglang(self) -> dict[str, Any]:
        """SGLang's `sampling_params` dict (its key names: the seed is `sampling_seed`)."""
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": self.min_new_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
        }
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = True
    return_routed_experts: bool = False


@dataclass
class GenerateResult:
    """One finished (or aborted) request.

    `output_logprobs[i]` is the log-prob of `output_ids[i]` (SGLang's convention: under the
    temperature-scaled distribution, before top-k/top-p; see docs/engines.md), and
    `weight_versions[i]` the weight version that generated it. `routed_experts`, when asked
    for, is int32 of shape [len(input_ids) + len(output_ids) - 1, num_layers, top_k]: the
    experts each fed token was routed to (the last sampled token is never fed).
    """

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    weight_versions: list[int]
    routed_experts: np.ndarray | None = None
    prompt_tokens: int = 0
    text: str = ""
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def weight_version(self) -> int | None:
        """The version of the last token (None if nothing was generated)."""
        return self.weight_versions[-1] if self.weight_versions else None


class EngineError(RuntimeError):
    """A request an engine refused or could not serve; names the endpoint and the status."""

    def __init__(self, message: str, *, endpoint: str = "", status: int | None = None,
                 body: str = ""):
        super().__init__(message)
        self.endpoint = endpoint
        self.status = status
        self.body = body


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout scheduler and the trainer use. All calls are async."""

    @property
    def weight_version(self) -> int:
        """The weight version last set through this engine (or read from the server)."""
        ...

    async def generate(self, req: GenerateRequest) -> GenerateResult: ...

    async def abort(self, rid: str) -> None:
        """Abort one request; its `generate` returns the partial output with 'abort'."""
        ...

    async def pause_generation(self, mode: PauseMode = "retract") -> None:
        """Stop decoding: 'abort' ends in-flight requests, 'retract'/'in_place' hold them."""
        ...

    async def continue_generation(self) -> None: ...

    async def update_weights_from_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int
    ) -> None:
        """Load HF-named tensors (any subset of the model) and set the weight version."""
        ...

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None: ...

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """Free SGLang memory regions (`MEMORY_TAGS`; None: all): colocated training."""
        ...

    async def resume_memory(self, tags: list[str] | None = None) -> None: ...

    async def flush_cache(self) -> None: ...

    async def health(self) -> bool: ...


class NoServerControl:
    """The control calls of an engine with no server to pause, release or flush (a scripted
    policy, a hosted chat model): no-ops, and always healthy."""

    async def abort(self, rid: str) -> None:
        return None

    async def pause_generation(self, mode: PauseMode = "retract") -> None:
        return None

    async def continue_generation(self) -> None:
        return None

    async def release_memory(self, tags: list[str] | None = None) -> None:
        return None

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        return None

    async def flush_cache(self) -> None:
        return None

    async def health(self) -> bool:
        return True
