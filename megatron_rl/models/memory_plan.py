"""Memory planner: per-GPU bytes of a Megatron layout before anything is launched.

`plan_config(cfg)` reads a recipe's model, parallel, optim, train and rollout sections and
returns, per pipeline stage, the weights, gradients, optimizer states, activations and the
rollout engine's share, against the GPU's memory; `propose()` searches TP/PP/EP/ETP/CP and
optimizer offload for the fewest GPUs that fit. The formulas and their sources are in
docs/planner.md; `tests/test_plan.py` checks the parameter counts against built models and the
total against a measured CPU step.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config.fields import ConfigError
from megatron_rl.config.schema import Config
from megatron_rl.models.registry import ModelSpec, get_model_spec, model_spec

GiB = 1 << 30


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float  # what the driver reports as total (nvidia-smi), not the marketing size
    gpus_per_node: int = 8
    shared: bool = False  # CPU: every rank of the node draws on the same memory


DEVICES = {
    "h20": Device("h20", 95.6),    # 97,871 MiB reported for the 96 GB part
    "h100": Device("h100", 79.6),
    "h800": Device("h800", 79.6),
    "h200": Device("h200", 139.8),
    "a100": Device("a100", 79.2),
}

# Fixed costs outside the formulas (docs/planner.md "Constants"): a CUDA context with NCCL's
# buffers per process on the GPU; an SGLang server's memory outside mem_fraction_static
# (CUDA graphs, sampling buffers); the share of the GPU the PyTorch caching allocator loses to
# fragmentation, kept free by the fit test.
CUDA_CONTEXT_GIB = 1.0
ENGINE_RUNTIME_GIB = 3.0
HEADROOM = 0.08
SGLANG_DEFAULT_MEM_FRACTION = 0.88
GDN_CHUNK = 64  # megatron's chunk size of the Gated DeltaNet delta rule


def cpu_device() -> Device:
    """This machine's memory, shared by all ranks (the CPU recipes' 'GPU')."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        total = kib * 1024 / GiB
    except (OSError, StopIteration, ValueError):
        total = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / GiB
    return Device("cpu", round(total, 1), gpus_per_node=1, shared=True)


def get_device(name: str) -> Device:
    if name == "cpu":
        return cpu_device()
    if name not in DEVICES:
        raise ConfigError(f"--gpu {name!r}: unknown; known: cpu, {', '.join(DEVICES)}")
    return DEVICES[name]


@dataclass(frozen=True)
class Layout:
    """A trainer layout: Megatron's parallel sizes, optimizer sharding/offload, recompute."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    world: int = 1
    sp: bool = False
    distributed_optimizer: bool = True
    offload: float = 0.0  # share of the optimizer states (and their step) on the CPU
    recompute: str = "none"  # none | selective | full

    @property
    def dp(self) -> int:
        """Data parallel of the dense parameters (their optimizer shards over DP x CP)."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Expert data parallel: the ranks that hold the same experts."""
        return self.world // (self.ep * self.etp * self.pp)

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"EP{self.ep}", f"ETP{self.etp}",
                 f"CP{self.cp}", f"DP{self.dp}"]
        extra = []
        if self.sp:
            extra.append("SP")
        if self.distributed_optimizer:
            extra.append("dist-opt")
        if self.offload:
            extra.append(f"offload {self.offload:g}")
        if self.recompute != "none":
            extra.append(f"recompute {self.recompute}")
        return " ".join(parts) + (f" ({', '.join(extra)})" if extra else "")


# a chunk's logits up to this size are kept for backward (models/logprobs.py), not recomputed:
# on a GPU memory is what runs short; on a CPU host the matmul (the quickstart's pre-training,
# 34k ids: 0.82 s -> 0.70-0.73 s a step with logprobs' row blocks, the same values bit for bit)
KEEP_LOGITS_BYTES = {"cuda": 64 << 20, "cpu": 1 << 30}


def keep_logits_bytes(device_type: str) -> int:
    return KEEP_LOGITS_BYTES.get(device_type, KEEP_LOGITS_BYTES["cuda"])


@dataclass(frozen=True)
class Workload:
    """What one micro-batch costs: tokens per DP rank, element size, the kernels in use."""

    tokens: int  # per micro-batch per DP rank (split over CP)
    dtype_bytes: int = 2
    attention: str = "flash"  # flash (TE/cuDNN on GPU) | local (megatron's unfused, CPU)
    seq_length: int = 4096  # longest row: the unfused attention's key length
    microbatches: int = 1 << 30  # per step per DP rank; >= PP fills the 1F1B pipeline
    logprob_chunk_tokens: int = 4096
    keep_logits_bytes: int = 64 << 20  # a chunk's logits up to this stay for backward


@dataclass(frozen=True)
class Engine:
    """The rollout engines' claim on the GPUs."""

    kind: str = "none"  # none | sglang | embedded | other
    layout: str = "colocated"
    num_engines: int = 0
    gpus: int = 0  # per engine (its TP)
    ep: int = 1
    mem_fraction: float | None = None
    kv_tokens: int = 262144  # KV cache an engine must hold: e.g. 8 concurrent 32k rollouts
    weight_bytes: float = 2.0  # per parameter served: bf16, or 1 for an FP8 checkpoint

    @property
    def total_gpus(self) -> int:
        return self.num_engines * self.gpus


# -- parameters per rank ----------------------------------------------------------------------

def padded_vocab(spec: ModelSpec, tp: int) -> int:
    """As models.builder.padded_vocab_size (importing it would pull in torch)."""
    return math.ceil(spec.vocab_size / tp) * tp


def _mixer_params(spec: ModelSpec, kind: str, tp: int) -> int:
    h = spec.hidden_size
    if kind == "full_attention":
        q = spec.num_attention_heads * spec.head_dim
        kv = spec.num_query_groups * spec.head_dim
        qkv = (q * (2 if spec.attention_output_gate else 1) + 2 * kv) * h // tp
        norms = 2 * spec.head_dim if spec.qk_layernorm else 0  # replicated over TP
        return qkv + q * h // tp + norms
    la = spec.linear_attention
    k_dim, v_dim = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
    conv_dim = 2 * k_dim + v_dim
    in_proj = h * (conv_dim + v_dim + 2 * la.num_value_heads) // tp  # qkv, z, b, a
    return (in_proj + conv_dim * la.conv_kernel // tp + 2 * la.num_value_heads // tp
            + la.value_head_dim + v_dim * h // tp)  # conv1d, A_log + dt_bias, out_norm, out_proj


def _mlp_params(spec: ModelSpec, lay: Layout) -> tuple[int, int]:
    """(dense, expert) parameters of one layer's MLP on a rank."""
    h = spec.hidden_size
    if not spec.is_moe:
        return 3 * h * spec.ffn_hidden_size // lay.tp, 0
    dense = spec.num_experts * h  # the router, replicated over TP
    if spec.shared_expert_ffn_hidden_size:
        dense += 3 * h * spec.shared_expert_ffn_hidden_size // lay.tp
        dense += h if spec.shared_expert_gate else 0
    experts = spec.num_experts // lay.ep * 3 * h * spec.moe_ffn_hidden_size // lay.etp
    return dense, experts


def stage_layers(spec: ModelSpec, pp: int, stage: int) -> list[str]:
    per = spec.num_layers // pp
    return spec.layer_types[stage * per:(stage + 1) * per]


def rank_parameters(spec: ModelSpec, lay: Layout, stage: int = 0) -> tuple[int, int]:
    """(dense, expert) parameters a rank of pipeline stage `stage` holds, as megatron-core
    builds them (GPTModel with this project's layer specs)."""
    h, first, last = spec.hidden_size, stage == 0, stage == lay.pp - 1
    mlp_dense, mlp_expert = _mlp_params(spec, lay)
    dense, expert = 0, 0
    for kind in stage_layers(spec, lay.pp, stage):
        dense += _mixer_params(spec, kind, lay.tp) + mlp_dense + 2 * h  # + the two norms
        expert += mlp_expert
    emb = padded_vocab(spec, lay.tp) * h // lay.tp
    mtp = spec.mtp_num_layers > 0
    if first or (last and mtp):  # the MTP block embeds its own inputs on the last stage
        dense += emb
    if last:
        dense += h  # final norm
        if not (spec.tie_word_embeddings and first):  # tied on one stage: the same tensor
            dense += emb
        for _ in range(spec.mtp_num_layers):  # enorm, hnorm, eh_proj, a full layer, norm
            dense += 3 * h + 2 * h * h // lay.tp
            dense += _mixer_params(spec, "full_attention", lay.tp) + mlp_dense + 2 * h
            expert += mlp_expert
    return dense, expert


def layout_problems(spec: ModelSpec, lay: Layout) -> list[str]:
    """Why megatron-core (or this project) would refuse the layout; empty when it builds."""
    out = []
    mp = lay.tp * lay.pp * lay.cp
    if lay.world % mp:
        out.append(f"world {lay.world} is not a multiple of tp*pp*cp={mp}")
    elif (lay.world // lay.pp) % (lay.ep * lay.etp):
        out.append(f"ep*etp={lay.ep * lay.etp} does not divide the {lay.world // lay.pp} "
                   "ranks of a pipeline stage")
    if spec.num_layers % lay.pp:
        out.append(f"pp={lay.pp} does not divide num_layers={spec.num_layers}")
    if spec.num_attention_heads % lay.tp or spec.num_query_groups % lay.tp:
        out.append(f"tp={lay.tp} does not divide the {spec.num_attention_heads} heads / "
                   f"{spec.num_query_groups} KV groups")
    la = spec.linear_attention
    if la is not None and (la.num_key_heads % lay.tp or la.num_value_heads % lay.tp):
        out.append(f"tp={lay.tp} does not divide the linear-attention heads")
    if spec.is_moe:
        if spec.num_experts % lay.ep:
            out.append(f"ep={lay.ep} does not divide num_experts={spec.num_experts}")
        if spec.moe_ffn_hidden_size % lay.etp:
            out.append(f"etp={lay.etp} does not divide moe_ffn_hidden_size")
    elif lay.ep > 1 or lay.etp > 1:
        out.append("ep/etp > 1 on a dense model")
    if lay.offload and not lay.distributed_optimizer:
        out.append("optimizer offload needs the distributed optimizer")
    return out


# -- bytes per rank ---------------------------------------------------------------------------

def _layer_activation_elems(spec: ModelSpec, kind: str, lay: Layout, wl: Workload,
                            ) -> tuple[float, float]:
    """(elements, fp32 elements) autograd keeps per token for one layer without recompute.

    Korthikanti et al. 2022 (arXiv 2205.05198) style, itemised for this architecture (no
    dropout, no biases, SwiGLU, GQA, MoE, Gated DeltaNet); docs/planner.md lists each term."""
    h, t = spec.hidden_size, lay.tp
    sp = t if lay.sp else 1  # norms and residual-stream tensors are sharded only under SP
    elems = fp32 = 0.0
    elems += 2 * h / sp  # input norm's input, the mixer's input (norm output)
    if kind == "full_attention":
        q = spec.num_attention_heads * spec.head_dim / t
        kv = spec.num_query_groups * spec.head_dim / t
        gate = q if spec.attention_output_gate else 0
        elems += (q + kv) if spec.qk_layernorm else 0  # q/k norms' inputs
        core = q + 2 * kv + q  # q, k, v into the kernel and its output
        if wl.attention == "local" and lay.recompute == "none":
            # megatron's unfused attention keeps the softmax probabilities [heads, sq, sk]
            core += spec.num_attention_heads / t * min(wl.seq_length, wl.tokens)
        elif lay.recompute == "selective":
            core = q + 2 * kv  # core_attn recomputed: only its inputs stay
        fp32 += spec.num_attention_heads / t  # softmax statistics (flash: log-sum-exp)
        elems += core + 2 * gate + q  # sigmoid(gate) and output for the gate, proj input
    else:
        la = spec.linear_attention
        k_dim = la.num_key_heads * la.key_head_dim / t
        v_dim = la.num_value_heads * la.value_head_dim / t
        nv = la.num_value_heads / t
        conv_dim = 2 * k_dim + v_dim
        # in_proj output; conv input and output (+ SiLU); q/k L2 norms; the delta rule's
        # inputs (q, k, v, g, beta) and output; gated norm's inputs (x, z); out_proj input
        elems += (conv_dim + v_dim + 2 * nv) + 2 * conv_dim + 2 * k_dim
        elems += (conv_dim + 2 * nv) + v_dim + 2 * v_dim + v_dim
        fp32 += 2 * nv  # decay and beta in fp32
        if wl.attention == "local":
            # megatron's torch_chunk_gated_delta_rule (CPU; GPUs run FLA's kernels): per
            # value head, the row clones of its in-chunk triangular solve (~C^2/3 per token,
            # C = 64), ~6 C-wide decay/attention rows, two chunk states, ~10 fp32 copies of
            # q/k/v (transposed, padded, scaled, beta-weighted, cumulative decay)
            c = GDN_CHUNK
            dk, dv = la.key_head_dim, la.value_head_dim
            fp32 += nv * (c * c / 3 + 6 * c + 2 * dk * dv / c + 5 * (dk + dv))
    elems += 2 * h / sp  # pre-MLP norm's input, the MLP's input
    if spec.is_moe:
        k, e = spec.moe_router_topk, spec.num_experts
        fe = spec.moe_ffn_hidden_size / lay.etp
        fp32 += 3 * e / sp  # router logits, scores, aux-loss probabilities
        # each token's k copies, over the ranks of the TP group (SP) or not: dispatched input,
        # fc1 output (2f), SiLU and product (2f), the expert output weighted by its prob
        routed = k * lay.etp / sp
        elems += routed * (2 * h + 4 * fe)
        if spec.shared_expert_ffn_hidden_size:
            elems += 4 * spec.shared_expert_ffn_hidden_size / t + 1
    else:
        elems += 4 * spec.ffn_hidden_size / t  # fc1 output (2f), SiLU, product
    return elems, fp32


def stage_activations(spec: ModelSpec, lay: Layout, wl: Workload, stage: int
                      ) -> tuple[float, float]:
    """(kept activations, transient peak) bytes of a stage's rank for its micro-batches in
    flight (1F1B: stage s holds pp - s of them)."""
    tokens = wl.tokens / lay.cp
    e = wl.dtype_bytes
    layers = stage_layers(spec, lay.pp, stage)
    last = stage == lay.pp - 1
    if last:
        layers = layers + ["full_attention"] * spec.mtp_num_layers
    per_layer = [_layer_activation_elems(spec, kind, lay, wl) for kind in layers]
    full = [tokens * (el * e + f32 * 4) for el, f32 in per_layer]
    if lay.recompute == "full":
        # each layer keeps its input; one layer's activations live again in its backward
        sp = lay.tp if lay.sp else 1
        kept = len(layers) * tokens * spec.hidden_size / sp * e
        recomputed = max(full, default=0.0)
    else:
        kept, recomputed = sum(full), 0.0
    if last:  # the output layer's input; MTP's eh_proj input and its two norms
        kept += tokens * spec.hidden_size * e * (1 + 4 * spec.mtp_num_layers)
    in_flight = min(lay.pp - stage, wl.microbatches)
    transient = recomputed
    if last:
        # fp32 logits (models/logprobs.py): a chunk's, recomputed in backward as its gradient;
        # or, when small enough to keep, every chunk's of the micro-batch (each becomes its
        # gradient in place)
        row = padded_vocab(spec, lay.tp) / lay.tp * 4
        chunk = min(tokens, wl.logprob_chunk_tokens) * row
        transient += tokens * row if chunk <= wl.keep_logits_bytes else 2 * chunk
    if wl.attention == "local" and "full_attention" in layers:
        # the unfused softmax's backward: the gradients of the probabilities and of the
        # scores, [heads, sq, sk] each (+ the probabilities themselves when recomputed)
        heads = spec.num_attention_heads / lay.tp
        copies = 2 + (lay.recompute != "none")
        transient += copies * heads * tokens * min(wl.seq_length, wl.tokens) * e
    return kept * in_flight, transient


@dataclass
class StageMemory:
    stage: int
    dense_params: int
    expert_params: int
    weights: float
    grads: float
    optimizer: float
    optimizer_offloaded: float
    activations: float
    transient: float
    engine: float
    overhead: float
    resident: float = 0.0  # trainer bytes left on the GPU while the engines generate

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params

    @property
    def train_peak(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations + self.transient
                + self.overhead)

    @property
    def peak(self) -> float:
        """The larger of the training phase and the rollout phase (colocated engines)."""
        rollout = self.resident + self.engine + self.overhead
        return max(self.train_peak, rollout)


@dataclass
class Plan:
    model: str
    device: Device
    layout: Layout
    workload: Workload
    engine: Engine
    stages: list[StageMemory]
    engine_gpu_peak: float  # disaggregated engines: bytes per engine GPU
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    model_params: int = 0
    aux_gpus: int = 0  # aux engine pools (judges, summarizers) in bundles of their own
    engine_need: float = 0.0  # bytes an engine GPU needs in its claim: weights + KV cache

    @property
    def trainer_gpus(self) -> int:
        return self.layout.world

    @property
    def gpus(self) -> int:
        extra = self.engine.total_gpus if self.engine.layout == "disaggregated" else 0
        return self.layout.world + extra + self.aux_gpus

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.device.gpus_per_node)

    @property
    def peak(self) -> float:
        """Bytes on the fullest GPU (or, on a shared CPU node, on the whole machine)."""
        if self.device.shared:
            ranks = self.layout.world // self.layout.pp
            return (sum(s.peak for s in self.stages) * ranks + self.engine_gpu_peak)
        return max([s.peak for s in self.stages] + [self.engine_gpu_peak])

    @property
    def usable(self) -> float:
        return self.device.memory_gib * GiB * (1 - HEADROOM)

    @property
    def trainer_peak(self) -> float:
        return max((s.peak for s in self.stages), default=0.0)

    @property
    def fits(self) -> bool:
        """Every trainer GPU within the usable share; SGLang's own GPUs within the GPU (it
        sizes its pool once, so the allocator's fragmentation does not apply)."""
        if self.problems:
            return False
        if self.device.shared:
            return self.peak <= self.usable
        return (self.trainer_peak <= self.usable
                and self.engine_gpu_peak <= self.device.memory_gib * GiB)

    def to_dict(self) -> dict[str, Any]:
        def gib(x: float) -> float:
            return round(x / GiB, 3)

        return {
            "model": self.model, "device": dataclasses.asdict(self.device),
            "layout": dataclasses.asdict(self.layout) | {"dp": self.layout.dp,
                                                         "edp": self.layout.edp},
            "workload": dataclasses.asdict(self.workload),
            "engine": dataclasses.asdict(self.engine),
            "gpus": self.gpus, "trainer_gpus": self.trainer_gpus, "nodes": self.nodes,
            "stages": [{"stage": s.stage, "params": s.params, "dense_params": s.dense_params,
                        "expert_params": s.expert_params, "weights_gib": gib(s.weights),
                        "grads_gib": gib(s.grads), "optimizer_gib": gib(s.optimizer),
                        "optimizer_offloaded_gib": gib(s.optimizer_offloaded),
                        "activations_gib": gib(s.activations),
                        "transient_gib": gib(s.transient), "engine_gib": gib(s.engine),
                        "overhead_gib": gib(s.overhead), "train_peak_gib": gib(s.train_peak),
                        "peak_gib": gib(s.peak)} for s in self.stages],
            "engine_gpu_peak_gib": gib(self.engine_gpu_peak),
            "peak_gib": gib(self.peak), "usable_gib": gib(self.usable), "fits": self.fits,
            "problems": self.problems, "notes": self.notes,
        }


def kv_bytes_per_token(spec: ModelSpec, tp: int) -> float:
    """bf16 K and V of the full-attention layers on one of an engine's `tp` GPUs (KV heads
    are replicated when TP exceeds them; Gated DeltaNet layers keep a per-sequence state
    instead, left out here: docs/planner.md)."""
    full = spec.layer_types.count("full_attention")
    return full * 2 * max(spec.num_query_groups / tp, 1) * spec.head_dim * 2


def engine_static_bytes(spec: ModelSpec, engine: Engine, device: Device
                        ) -> tuple[float, float]:
    """(claim, need) bytes per engine GPU: SGLang claims mem_fraction_static of the GPU (plus
    its runtime) and needs its bf16 weight shard and `kv_tokens` of KV cache inside the claim;
    the embedded CPU engine holds an fp32 copy of the model."""
    if engine.kind == "none" or engine.num_engines == 0:
        return 0.0, 0.0
    if engine.kind == "embedded" or engine.gpus == 0:
        weights = spec.num_parameters() * 4.0 * engine.num_engines
        return weights, weights
    need = (spec.num_parameters() * engine.weight_bytes / engine.gpus
            + engine.kv_tokens * kv_bytes_per_token(spec, engine.gpus))
    fraction = engine.mem_fraction or SGLANG_DEFAULT_MEM_FRACTION
    return fraction * device.memory_gib * GiB + ENGINE_RUNTIME_GIB * GiB, need


def plan(spec: ModelSpec, lay: Layout, wl: Workload, engine: Engine, device: Device) -> Plan:
    """Per-stage memory of a rank at layout `lay` (one rank per GPU)."""
    problems = layout_problems(spec, lay)
    notes: list[str] = []
    if problems:
        return Plan(spec.name, device, lay, wl, engine, [], 0.0, problems, notes,
                    model_params=spec.num_parameters())
    claim, need = engine_static_bytes(spec, engine, device)
    on_gpu = not device.shared
    colocated = engine.layout == "colocated" and engine.num_engines > 0
    if on_gpu and engine.gpus > device.gpus_per_node:
        problems.append(f"rollout.engine_gpus={engine.gpus}: an engine spans at most one node "
                        f"({device.gpus_per_node} GPUs; the SGLang launcher starts single-node "
                        "servers)")
    if on_gpu and engine.kind == "sglang" and need > claim - ENGINE_RUNTIME_GIB * GiB:
        problems.append(f"engine: weights + {engine.kv_tokens} tokens of KV cache need "
                        f"{need / GiB:.1f} GiB per GPU, more than its mem_fraction claims; "
                        "raise rollout.engine_gpus or rollout.engine_mem_fraction")
    if on_gpu and engine.kind == "sglang" and engine.mem_fraction is None:
        notes.append(f"rollout.engine_mem_fraction unset: SGLang's default "
                     f"{SGLANG_DEFAULT_MEM_FRACTION} assumed")
    e_param = wl.dtype_bytes
    # fp32 main params + Adam moments; an fp32 model's params are their own main copy
    opt_bytes = 8 + (4 if e_param < 4 else 0)
    stages = []
    for s in range(lay.pp):
        dense, expert = rank_parameters(spec, lay, s)
        if lay.distributed_optimizer:
            opt = dense * opt_bytes / (lay.dp * lay.cp) + expert * opt_bytes / lay.edp
        else:
            opt = (dense + expert) * opt_bytes
        acts, transient = stage_activations(spec, lay, wl, s)
        # a colocated engine with its memory released still holds its CUDA context
        engine_share = (claim if colocated else 0.0) if on_gpu else 0.0
        overhead = CUDA_CONTEXT_GIB * GiB * (2 if colocated else 1) if on_gpu else 0.0
        stages.append(StageMemory(
            stage=s, dense_params=dense, expert_params=expert,
            weights=(dense + expert) * e_param, grads=(dense + expert) * 4.0,  # fp32 grad buffer
            optimizer=opt * (1 - lay.offload), optimizer_offloaded=opt * lay.offload,
            activations=acts, transient=transient, engine=engine_share, overhead=overhead,
            # colocated, the trainer offloads weights, grads and optimizer to pinned host
            # memory before every rollout (engines/colocation.py, trainer/offload.py)
            resident=0.0 if colocated and on_gpu else
            (dense + expert) * (e_param + 4.0) + opt * (1 - lay.offload)))
    if device.shared:  # CPU: engines are processes on the same machine
        engine_peak = claim
    else:
        engine_peak = claim + CUDA_CONTEXT_GIB * GiB if engine.layout == "disaggregated" else 0.0
    if on_gpu and lay.offload:
        host = (sum(s.optimizer_offloaded for s in stages) / lay.pp
                * min(lay.world, device.gpus_per_node))
        notes.append(f"offloaded optimizer: ~{host / GiB:.0f} GiB of host memory per node")
    if on_gpu and colocated:
        parked = (max(s.weights + s.grads + s.optimizer for s in stages)
                  * min(lay.world, device.gpus_per_node))
        notes.append(f"colocated: the trainer parks ~{parked / GiB:.0f} GiB per node in pinned "
                     "host memory while the engines generate")
    return Plan(spec.name, device, lay, wl, engine, stages, engine_peak, problems, notes,
                model_params=spec.num_parameters(), engine_need=need)


# -- from a recipe ----------------------------------------------------------------------------

def trainer_world(cfg: Config) -> int:
    """Trainer ranks of a recipe: rollout.trainer_ranks when it holds the layout, else the
    fewest ranks that do (the lm-train / SFT default, distributed.process_groups)."""
    p = cfg.parallel
    mp = p.tp * p.pp * p.cp
    dp = 1
    while (dp * p.tp * p.cp) % (p.ep * p.etp):
        dp += 1
    least = mp * dp
    ranks = cfg.rollout.trainer_ranks
    return ranks if ranks % least == 0 and (ranks // p.pp) % (p.ep * p.etp) == 0 else least


def recompute_of(cfg: Config) -> str:
    return cfg.model.recompute_granularity if cfg.model.recompute_activations else "none"


def workload_of(cfg: Config, device: Device, dp: int = 1) -> Workload:
    """A recipe's micro-batch: its token budget per DP rank, else rows x seq_length."""
    t, m = cfg.train, cfg.model
    tokens = t.max_tokens_per_microbatch or t.micro_batch_size * m.seq_length
    uses_te = m.layer_impl == "transformer_engine" or (m.layer_impl == "auto"
                                                       and not device.shared)
    return Workload(tokens=tokens, dtype_bytes=4 if m.dtype == "fp32" else 2,
                    attention="flash" if uses_te else "local", seq_length=m.seq_length,
                    microbatches=max(1, t.global_batch_size // (t.micro_batch_size * dp)),
                    logprob_chunk_tokens=t.logprob_chunk_tokens,
                    keep_logits_bytes=keep_logits_bytes("cpu" if device.shared else "cuda"))


def layout_of(cfg: Config) -> Layout:
    p = cfg.parallel
    return Layout(tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp, cp=p.cp, world=trainer_world(cfg),
                  sp=p.sequence_parallel, distributed_optimizer=p.distributed_optimizer,
                  offload=cfg.optim.cpu_offload_fraction,
                  recompute=recompute_of(cfg))


def engine_of(cfg: Config) -> Engine:
    ro = cfg.rollout
    kind = ro.engine if ro.engine in ("sglang", "embedded") else "other"
    return Engine(kind=kind, layout=ro.layout, num_engines=ro.num_engines, gpus=ro.engine_gpus,
                  ep=ro.engine_ep, mem_fraction=ro.engine_mem_fraction,
                  # an engine serving an FP8 checkpoint (weights synced as FP8, docs/fp8.md)
                  weight_bytes=1.0 if ro.sync_fp8 else 2.0)


def device_of(cfg: Config, gpu: str = "h20") -> Device:
    """CPU recipes (no trainer GPUs, not nccl) are checked against this machine's memory."""
    on_cpu = cfg.rollout.trainer_gpus == 0 and cfg.parallel.backend != "nccl"
    return cpu_device() if on_cpu else get_device(gpu)


def plan_config(cfg: Config, gpu: str = "h20", spec: ModelSpec | None = None) -> Plan:
    """The plan of a loaded recipe. `model.hf_path` names the architecture when its
    config.json is here; elsewhere (planning before the checkpoint is copied) `model.name`."""
    notes = []
    if spec is None:
        try:
            spec = model_spec(cfg.model)
        except ConfigError:
            if not cfg.model.hf_path:
                raise
            spec = get_model_spec(cfg.model.name)
            notes.append(f"model.hf_path={cfg.model.hf_path!r} is not on this machine: "
                         f"planned from the registry entry model.name={cfg.model.name!r}")
    device, lay = device_of(cfg, gpu), layout_of(cfg)
    result = plan(spec, lay, workload_of(cfg, device, lay.dp), engine_of(cfg), device)
    result.aux_gpus = sum(pool.num_engines * pool.engine_gpus
                          for pool in cfg.rollout.aux_pools.values())
    result.notes = notes + result.notes
    return result


# -- proposing a layout -----------------------------------------------------------------------

def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def candidate_layouts(spec: ModelSpec, world: int, *, recompute: str = "full",
                      max_tp: int = 8) -> list[Layout]:
    """Layouts megatron-core builds on `world` GPUs (TP and ETP within a node)."""
    out = []
    experts = spec.num_experts or 1
    for tp in (d for d in (1, 2, 4, 8) if d <= max_tp and world % d == 0):
        for cp in (d for d in (1, 2, 4, 8) if world % (tp * d) == 0):
            for pp in _divisors(spec.num_layers, world // (tp * cp)):
                if world % (tp * cp * pp):
                    continue
                per_stage = world // pp
                for ep in _divisors(experts, per_stage) if spec.is_moe else [1]:
                    for etp in ((1, tp) if tp > 1 and spec.is_moe else (1,)):
                        if per_stage % (ep * etp):
                            continue
                        for offload in (0.0, 1.0):
                            lay = Layout(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp, world=world,
                                         sp=tp > 1, distributed_optimizer=True,
                                         offload=offload, recompute=recompute)
                            if not layout_problems(spec, lay):
                                out.append(lay)
    return out


def fit_engine_fraction(p: Plan, step: float = 0.05) -> Plan:
    """A colocated SGLang plan with the largest mem_fraction_static that fits beside the
    trainer's resident state, if one leaves the engine its weights plus a quarter for the KV
    cache; else `p` unchanged."""
    eng = p.engine
    if p.device.shared or eng.kind != "sglang" or eng.layout != "colocated" or not p.stages:
        return p
    if any("engine" not in problem for problem in p.problems):
        return p  # the trainer layout itself is wrong
    resident = max(s.resident + s.overhead for s in p.stages)
    train = max(s.train_peak for s in p.stages)
    room = p.usable - resident - ENGINE_RUNTIME_GIB * GiB
    fraction = math.floor(room / (p.device.memory_gib * GiB) / step) * step
    if fraction * p.device.memory_gib * GiB < p.engine_need or train > p.usable:
        return p
    fraction = round(min(fraction, SGLANG_DEFAULT_MEM_FRACTION), 2)
    return dataclasses.replace(p, engine=dataclasses.replace(eng, mem_fraction=fraction),
                               stages=[dataclasses.replace(s, engine=fraction * GiB
                                       * p.device.memory_gib + ENGINE_RUNTIME_GIB * GiB)
                                       for s in p.stages], notes=[], problems=[])


def _cost(p: Plan) -> tuple:
    # fewest GPUs, then no offload (its CPU step is slow), then the least model parallelism
    # (each split adds communication), then headroom
    lay = p.layout
    return (p.gpus, lay.offload > 0, lay.pp, lay.tp * lay.cp, lay.etp, -lay.ep, p.peak)


def propose(spec: ModelSpec, wl: Workload, engine: Engine, device: Device, *,
            min_gpus: int = 1, max_nodes: int = 64, recompute: str = "full",
            world: int | None = None, fit_fraction: bool = True) -> Plan | None:
    """The cheapest layout (fewest GPUs first) whose every GPU fits; `world` pins the trainer
    GPUs (with the engines' GPUs on top when they are disaggregated); `fit_fraction` lets a
    colocated SGLang engine take what the trainer leaves (`fit_engine_fraction`)."""
    step = device.gpus_per_node
    extra = engine.total_gpus if engine.layout == "disaggregated" else 0
    if world is not None:
        worlds = [world]
    else:  # part of one node, then whole nodes
        small = [w for w in (1, 2, 4) if w + extra <= step]
        whole = [n * step - extra for n in range(1, max_nodes + 1) if n * step > extra]
        worlds = sorted({w for w in small + whole if w + extra >= min_gpus})
    for w in worlds:
        eng = engine
        if engine.layout == "colocated" and engine.gpus:  # an engine on every trainer GPU
            gpus = min(engine.gpus, w)
            eng = dataclasses.replace(engine, gpus=gpus, num_engines=max(1, w // gpus))
        plans = [plan(spec, lay, wl, eng, device)
                 for lay in candidate_layouts(spec, w, recompute=recompute)]
        if fit_fraction:
            plans = [fit_engine_fraction(p) if not p.fits else p for p in plans]
        fitting = [p for p in plans if p.fits]
        if fitting:
            return min(fitting, key=_cost)
    return None


def closest(spec: ModelSpec, wl: Workload, engine: Engine, device: Device, world: int,
            recompute: str = "full") -> Plan:
    """The layout on `world` GPUs with the smallest trainer peak, fitting or not."""
    plans = [plan(spec, lay, wl, engine, device)
             for lay in candidate_layouts(spec, world, recompute=recompute)]
    if not plans:
        return plan(spec, Layout(world=world, recompute=recompute), wl, engine, device)
    return min(plans, key=lambda p: p.trainer_peak)


# -- output -----------------------------------------------------------------------------------

def format_plan(p: Plan, proposal: Plan | None = None) -> str:
    def g(x: float) -> str:
        return f"{x / GiB:8.2f}"

    lines = [f"model {p.model}: {p.layout.describe()} on {p.trainer_gpus} trainer "
             f"{'rank' if p.device.shared else 'GPU'}(s)"]
    eng = p.engine
    if eng.num_engines:
        lines.append(f"engines: {eng.num_engines} x {eng.kind} ({eng.layout}), "
                     f"{eng.gpus} GPU(s) each, EP{eng.ep}, mem_fraction "
                     f"{eng.mem_fraction if eng.mem_fraction is not None else 'default'}")
    w = p.workload
    lines.append(f"micro-batch: {w.tokens} tokens per DP rank ({w.tokens // p.layout.cp} per "
                 f"GPU), {'bf16' if w.dtype_bytes == 2 else 'fp32'}, attention {w.attention}")
    for problem in p.problems:
        lines.append(f"  problem: {problem}")
    if p.stages:
        unit = "GiB per rank" if p.device.shared else "GiB per GPU"
        lines.append(f"{'stage':>5} {'params':>12} {'weights':>8} {'grads':>8} {'optim':>8} "
                     f"{'offload':>8} {'activ':>8} {'transnt':>8} {'engine':>8} {'other':>8} "
                     f"{'peak':>8}   ({unit})")
        for s in p.stages:
            lines.append(f"{s.stage:5d} {s.params:12,d} {g(s.weights)} {g(s.grads)} "
                         f"{g(s.optimizer)} {g(s.optimizer_offloaded)} {g(s.activations)} "
                         f"{g(s.transient)} {g(s.engine)} {g(s.overhead)} {g(s.peak)}")
    verdict = "fits" if p.fits else "does NOT fit"
    size = f"{p.device.memory_gib:g} GiB, {p.usable / GiB:.1f} usable"
    if p.device.shared:
        lines.append(f"peak {p.peak / GiB:.2f} GiB of this machine ({size}; all ranks and "
                     f"engines together): {verdict}")
    else:
        if p.engine_gpu_peak:
            lines.append(f"engine GPUs: {p.engine_gpu_peak / GiB:.2f} GiB each (of "
                         f"{p.device.memory_gib:g} GiB)")
        lines.append(f"trainer peak {p.trainer_peak / GiB:.2f} GiB per {p.device.name} GPU "
                     f"({size}): {verdict}; {p.gpus} GPU(s) = {p.nodes} node(s)")
    lines += [f"note: {n}" for n in p.notes]
    if proposal is not None:
        fraction = proposal.engine.mem_fraction
        lines.append(f"proposed: {proposal.layout.describe()} on {proposal.gpus} GPU(s) "
                     f"({proposal.nodes} node(s))"
                     + (f", engines {proposal.engine.num_engines} x TP{proposal.engine.gpus} at "
                        f"rollout.engine_mem_fraction={fraction}" if fraction else "")
                     + f"; peak {proposal.peak / GiB:.2f} GiB")
    elif not p.fits and not p.device.shared:
        lines.append("proposed: nothing fits within the searched nodes")
    return "\n".join(lines)
