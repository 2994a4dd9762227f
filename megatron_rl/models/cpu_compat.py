"""The ONE place where megatron-core is made to run on a CPU (gloo, no CUDA).

megatron-core 0.19.2 assumes CUDA in a few dozen call sites. Each shim below fixes one failure
that was seen on a CPU-only torch build; `probe()` reproduces that failure so a test can tell
when upstream no longer needs the shim. Shims are applied only when CUDA is absent and change
global torch behaviour, so only processes that will never touch a GPU ever call `apply()`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

APPLIED: list[str] = []


@dataclass(frozen=True)
class Shim:
    name: str
    why: str
    apply: Callable[[], None]
    probe: Callable[[], bool]  # True when the unpatched library still fails


def _raises(fn: Callable[[], object]) -> bool:
    try:
        fn()
    except (AssertionError, RuntimeError, TypeError, ValueError):
        return True
    return False


# -- rng: megatron's RNG tracker stores torch.cuda RNG states -------------------------------------
def _apply_rng() -> None:
    import megatron.core.tensor_parallel.random as mrandom

    class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_ or name in self.states_:
                raise ValueError(f"RNG state {name!r} / seed {seed} already added")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mrandom._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


# -- curdev: ~200 call sites place tensors on torch.cuda.current_device() -------------------------
def _apply_curdev() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")


# -- devcuda: ~90 hard-coded device="cuda" / .cuda() call sites ----------------------------------
def _is_cuda(d: object) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)  # a bare ordinal means a CUDA device


def _cpu_device(fn):
    @functools.wraps(fn)
    def w(*a, **k):
        if _is_cuda(k.get("device")):
            k["device"] = "cpu"
        return fn(*a, **k)
    return w


class _TorchWithCpuTensor(types.ModuleType):
    """`torch`, except that `tensor(..., device="cuda")` lands on the CPU."""

    def __init__(self):
        super().__init__("torch")
        self.tensor = _cpu_device(torch.tensor)

    def __getattr__(self, name):
        return getattr(torch, name)


# how megatron writes a CUDA-only torch.tensor call (tests re-scan megatron with it)
CUDA_TENSOR_CALL = re.compile(r"torch\.tensor\((?:[^()]|\([^()]*\))*?device=['\"]cuda")
# the modules on CPU training/checkpoint paths with such calls (GPU-only, inference and
# FSDP modules left out); tests/test_cpu_compat.py checks this list against megatron
TORCH_TENSOR_CUDA_MODULES = (
    "megatron.core.fp8_utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.hybrid_cp_schedule",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.layer_wise_optimizer",
    "megatron.core.tensor_parallel.data",
    "megatron.core.models.hybrid.hybrid_block",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)


def _patch_torch_tensor_in_megatron() -> None:
    """Replacing the global `torch.tensor` by a Python wrapper silently changes transformers'
    results (Qwen3-MoE logits off by ~1 when its modules are imported after it), so only the
    megatron modules that call torch.tensor(..., device="cuda") see a wrapped one."""
    import importlib

    for name in TORCH_TENSOR_CUDA_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            module.torch = _TorchWithCpuTensor()


def _apply_devcuda() -> None:
    for name in ("zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint",
                 "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "eye",
                 "linspace", "randperm", "triu_indices"):
        setattr(torch, name, _cpu_device(getattr(torch, name)))
    _patch_torch_tensor_in_megatron()
    torch.Tensor.cuda = lambda self, *a, **k: self
    orig_to = torch.Tensor.to

    def to(self, *a, **k):
        if a and _is_cuda(a[0]) and not isinstance(a[0], torch.dtype):
            a = ("cpu", *a[1:])
        if _is_cuda(k.get("device")):
            k["device"] = "cpu"
        return orig_to(self, *a, **k)

    torch.Tensor.to = to


# -- stream: alltoall dispatcher and DDP create CUDA streams/events --------------------------------
class _NoEvent:
    def __init__(self, *a, **k): ...
    def record(self, *a, **k): ...
    def synchronize(self): ...
    def wait(self, *a, **k): ...
    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class _NoStream:
    def __init__(self, *a, **k): ...
    def wait_stream(self, *a, **k): ...
    def wait_event(self, *a, **k): ...
    def synchronize(self): ...
    def record_event(self, *a, **k) -> _NoEvent:
        return _NoEvent()

    def __eq__(self, other) -> bool:
        return isinstance(other, _NoStream)

    def __hash__(self) -> int:
        return 0


def _apply_stream() -> None:
    default = _NoStream()
    torch.cuda.Stream, torch.cuda.Event = _NoStream, _NoEvent
    torch.cuda.current_stream = lambda *a, **k: default
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


# -- typestr: the optimizer classifies params by param.type() == "torch.cuda.FloatTensor" --------
def _apply_typestr() -> None:
    orig_type = torch.Tensor.type

    def type_(self, *a, **k):
        if not a and not k:
            t = orig_type(self)
            if t in ("torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor"):
                return t.replace("torch.", "torch.cuda.")
            return t
        return orig_type(self, *a, **k)

    torch.Tensor.type = type_


# -- sync: dist_checkpointing's writer calls torch.cuda.synchronize() ----------------------------
def _apply_sync() -> None:
    torch.cuda.synchronize = lambda *a, **k: None


# -- a2asplits: alltoall split sizes become numpy only for CUDA tensors -------------------------
def _apply_a2asplits() -> None:
    import megatron.core.transformer.moe.token_dispatcher as td

    orig = td.maybe_move_tensor_to_cpu

    def move(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    td.maybe_move_tensor_to_cpu = move


def _probe_a2asplits() -> bool:
    import megatron.core.transformer.moe.token_dispatcher as td

    return torch.is_tensor(td.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True))


# -- adamstep: without Apex/TE the inner optimizer is torch Adam with a per-param "step" tensor.
# megatron's distributed-optimizer load (a) hands ONE step tensor to every param, which Adam
# then increments once per param per step, and (b) never provides "step" to the
# fully_reshardable loader (KeyError)
def _apply_adamstep() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DO

    orig_set, orig_load = DO._set_main_param_and_optimizer_states, DO.load_state_dict

    def set_states(self, model_param, tensors):
        return orig_set(self, model_param, {"step": None, **tensors})  # None = keep loaded

    def load_state_dict(self, state_dict):
        orig_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    DO._set_main_param_and_optimizer_states = set_states
    DO.load_state_dict = load_state_dict


def _probe_adamstep() -> bool:
    import inspect

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DO

    return 's["step"] = step\n' in inspect.getsource(DO.load_state_dict)


# -- gdn: Gated DeltaNet (Qwen3.5) runs only on flash-linear-attention's Triton kernels -----------
def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _causal_conv1d(x, weight, bias=None, activation=None, initial_state=None,
                   output_final_state=False, cu_seqlens=None):
    """fla's `causal_conv1d` contract: x [b, s, d], weight [d, w] → ([b, s, d], final state)."""
    if initial_state is not None or output_final_state or cu_seqlens is not None:
        raise NotImplementedError("Gated DeltaNet with packed sequences or a conv state needs "
                                  "flash-linear-attention (GPU): pip install 'megatron-rl[gpu]'")
    seq = x.shape[1]
    y = torch.nn.functional.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias,
                                   padding=weight.shape[1] - 1, groups=x.shape[2])[..., :seq]
    if activation in ("silu", "swish"):
        y = torch.nn.functional.silu(y)
    return y.transpose(1, 2), None


def ensure_gdn_kernels() -> None:
    """Pure-PyTorch Gated DeltaNet kernels where fla's are missing (megatron's own torch
    chunked delta rule, a depthwise conv, an l2norm)."""
    from megatron.core.ssm.gated_delta_net import common, gdn

    if not common.HAVE_FLA:
        common.HAVE_FLA = True
        common.l2norm = _l2norm
        gdn.causal_conv1d = _causal_conv1d
        gdn.chunk_gated_delta_rule = common.torch_chunk_gated_delta_rule


# -- eager: megatron's `jit_fuser` is torch.compile -------------------------------------------
def _apply_eager() -> None:
    # On a CPU, inductor compiles C++ with g++ for every new shape of each fused helper (the
    # attention output gate, the router, GDN's): 29 s in tiny-qwen3.5's first step with a cold
    # cache, 5 s again at the second sequence length. Eager is the same math.
    torch.compiler.set_stance("force_eager")


def _probe_eager() -> bool:
    import megatron.core.jit

    # megatron still wraps its fused helpers (with torch.compile, or with `_undecorated` when
    # `import_megatron` imported it)
    return megatron.core.jit.jit_fuser is not megatron.core.jit.noop_decorator


# -- identitysort: the alltoall dispatcher re-sorts tokens by local expert even when one rank
# holds every expert (TP x EP = 1): the permutation is the identity and costs a full copy of
# the tokens (split + cat) forward and backward. On GPU TE fuses it; here it is skipped.
def _apply_identitysort() -> None:
    import megatron.core.transformer.moe.token_dispatcher as td

    orig = td.sort_chunks_by_idxs

    def sort(input, split_sizes, sorted_idxs, probs=None, fused=False):
        if torch.equal(sorted_idxs, torch.arange(len(sorted_idxs), device=sorted_idxs.device)):
            return input, probs
        return orig(input, split_sizes, sorted_idxs, probs=probs, fused=fused)

    td.sort_chunks_by_idxs = sort


def _probe_identitysort() -> bool:
    import megatron.core.transformer.moe.token_dispatcher as td

    x = torch.ones(2, 1)
    return td.sort_chunks_by_idxs(x, torch.tensor([1, 1]), torch.arange(2))[0] is not x


# -- rope: megatron's unfused RoPE recomputes cos and sin of the same frequencies for q and k of
# every layer and copies the result once more (a cat with the empty unrotated part); its
# backward negates half the gradient and concatenates the halves (chunk's backward). TE fuses
# it on GPU; here cos/sin are taken once per forward (the frequencies are one tensor), the
# copy is skipped when every channel rotates, and backward adds the rotated halves in place.
# The same values bit for bit.
class _Rope(torch.autograd.Function):
    """t * cos + rotate_half(t) * sin, rotate_half(t) = [-t2, t1] (halves of the last dim)."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        t1, t2 = torch.chunk(t, 2, dim=-1)  # megatron's `_rotate_half`, op for op
        return t * cos + torch.cat((-t2, t1), dim=-1) * sin

    @staticmethod
    def backward(ctx, g):
        # autograd's: g * cos + [g2 * sin2, -(g1 * sin1)]
        cos, sin = ctx.saved_tensors
        g_sin, grad = g * sin, g * cos
        half = grad.shape[-1] // 2
        grad[..., :half] += g_sin[..., half:]
        grad[..., half:] -= g_sin[..., :half]
        return grad, None, None


def _apply_rope() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    orig = rope_utils._apply_rotary_pos_emb_bshd
    last: list = [None, None, None]  # (frequencies, version, dtype), cos, sin

    def rope(t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
             multi_latent_attention=None):
        if (mla_rotary_interleaved or multi_latent_attention or mscale != 1.0
                or rotary_interleaved or freqs.shape[-1] != t.shape[-1] or freqs.requires_grad):
            return orig(t, freqs, rotary_interleaved, mla_rotary_interleaved, mscale,
                        multi_latent_attention)
        held = last[0]
        if held is None or held[0] is not freqs or held[1:] != (freqs._version, t.dtype):
            last[:] = [(freqs, freqs._version, t.dtype), torch.cos(freqs).to(t.dtype),
                       torch.sin(freqs).to(t.dtype)]
        return _Rope.apply(t, last[1], last[2])

    rope_utils._apply_rotary_pos_emb_bshd = rope


def _probe_rope() -> bool:
    import inspect

    from megatron.core.models.common.embeddings import rope_utils

    return "torch.cos(freqs)" in inspect.getsource(rope_utils._apply_rotary_pos_emb_bshd)


# -- onerank: a collective over a group of one rank changes nothing, yet gloo still runs it on
# its worker thread (40-170 us each). A one-rank train step makes five: megatron's gradient
# all-reduce at DP 1, its token-count broadcast and all-reduce (per-token loss), the grad-norm
# all-reduce, our metrics. Synchronous all_reduce / broadcast on one rank return at once, and
# so do megatron's tensor-parallel copy/reduce/scatter/gather autograd functions (identity
# forward and backward on one rank; seven a step, ~25 us each).
_IDENTITY_OPS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR")


def _apply_onerank() -> None:
    import torch.distributed as dist

    identity = {getattr(dist.ReduceOp, op) for op in _IDENTITY_OPS}

    def one_rank(group, async_op) -> bool:
        return not async_op and dist.get_world_size(group) == 1

    all_reduce, broadcast = dist.all_reduce, dist.broadcast

    @functools.wraps(all_reduce)
    def all_reduce_(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op in identity and one_rank(group, async_op):
            return None
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    @functools.wraps(broadcast)
    def broadcast_(tensor, src=None, group=None, async_op=False, group_src=None):
        if one_rank(group, async_op):
            return None
        return broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)

    dist.all_reduce, dist.broadcast = all_reduce_, broadcast_

    from megatron.core.tensor_parallel import mappings

    for cls in (mappings._CopyToModelParallelRegion, mappings._ReduceFromModelParallelRegion,
                mappings._ScatterToModelParallelRegion, mappings._GatherFromModelParallelRegion):
        def apply(cls, input_, group, _apply=cls.apply):
            return input_ if group.size() == 1 else _apply(input_, group)

        cls.apply = classmethod(apply)


def _probe_onerank() -> bool:
    import inspect

    import torch.distributed as dist

    # torch would have to return early itself (it checks the group's rank, not its size)
    return "get_world_size" not in inspect.getsource(dist.all_reduce)


# -- foreachnorm: without apex/TE megatron's grad-norm and clipping helpers loop in Python, one
# norm (read back as a float) and one `dst.copy_(src * scale)` per tensor. torch's foreach ops
# run the same per-tensor kernels in one call: the same values, ~10 us less per parameter.
def _apply_foreachnorm() -> None:
    import megatron.core.optimizer.clip_grads as clip
    import megatron.core.optimizer.optimizer as optim

    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        norms = [torch.stack(torch._foreach_norm(ts)) if ts else torch.zeros(0)
                 for ts in tensor_lists]
        total = torch.norm(torch.cat(norms))
        return torch.tensor([float(total)], dtype=torch.float), None

    def scale(chunk_size, noop_flag, tensor_lists, factor):
        src, dst = tensor_lists[0], tensor_lists[1]
        if all(s is d for s, d in zip(src, dst, strict=True)):
            torch._foreach_mul_(dst, factor)
        else:
            for s, d in zip(src, dst, strict=True):
                d.copy_(s * factor)

    for module in (clip, optim):
        if hasattr(module, "l2_norm_impl"):
            module.l2_norm_impl = l2_norm
        module.multi_tensor_scale_impl = scale


def _probe_foreachnorm() -> bool:
    import megatron.core.optimizer.clip_grads as clip
    from megatron.core.utils import local_multi_tensor_l2_norm

    return clip.l2_norm_impl is local_multi_tensor_l2_norm


# -- plainlinear: megatron's column/row-parallel linears run a Python autograd function even when
# it communicates nothing (no dgrad all-reduce, no sequence parallelism) and has no fused
# weight-gradient accumulation; then it computes exactly what torch's linear does (the same
# matmuls forward and backward), ~30 us less a call.
def _apply_plainlinear() -> None:
    from megatron.core.tensor_parallel import layers

    megatron_linear = layers.linear_with_grad_accumulation_and_async_allreduce

    @functools.wraps(megatron_linear)
    def linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
               sequence_parallel, grad_output_buffer=None, wgrad_deferral_limit=0,
               tp_group=None, gtp_remat_size=1):
        if (not gradient_accumulation_fusion and not allreduce_dgrad and not sequence_parallel
                and grad_output_buffer is None and gtp_remat_size == 1):
            out = torch.nn.functional.linear(input, weight)
            return out if bias is None else out + bias  # megatron adds the bias apart
        return megatron_linear(input, weight, bias, gradient_accumulation_fusion,
                               allreduce_dgrad, sequence_parallel, grad_output_buffer,
                               wgrad_deferral_limit, tp_group, gtp_remat_size)

    layers.linear_with_grad_accumulation_and_async_allreduce = linear

    # the MoE router's gate too: its function only casts to the router dtype around the matmuls
    import megatron.core.transformer.moe.router as router

    megatron_gate = router.router_gating_linear

    @functools.wraps(megatron_gate)
    def gate(inp, weight, bias, router_dtype):
        if bias is None and inp.dtype == weight.dtype == router_dtype:
            return torch.nn.functional.linear(inp, weight)
        return megatron_gate(inp, weight, bias, router_dtype)

    router.router_gating_linear = gate


def _probe_plainlinear() -> bool:
    import inspect

    from megatron.core.tensor_parallel import layers

    return "LinearWithGradAccumulationAndAsyncCommunication.apply" in inspect.getsource(
        layers.linear_with_grad_accumulation_and_async_allreduce)


# -- idlereset: megatron's grad finalisation walks every module after each step to reset the
# per-step router statistics of expert bias, global aux loss and quantile balancing (~0.2 ms
# of hasattr/getattr on the test model); without those features there is nothing to reset.
_RESET_BALANCING = ("global_aux_loss", "quantile_balancing")


def _apply_idlereset() -> None:
    import importlib

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    reset = finalize.reset_model_temporary_tensors

    @functools.wraps(reset)
    def reset_if_kept(config, model):
        balancing = config.moe_router_load_balancing_type
        kinds = balancing if isinstance(balancing, list | tuple) else [balancing]
        if config.moe_router_enable_expert_bias or any(
                name in str(kind) for kind in kinds for name in _RESET_BALANCING):
            reset(config, model)

    finalize.reset_model_temporary_tensors = reset_if_kept


def _probe_idlereset() -> bool:
    import importlib
    import inspect

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    return "'modules')()" in inspect.getsource(finalize.reset_model_temporary_tensors)


# -- gradinplace: megatron's DDP adds every parameter's gradient into its `main_grad` (a view of
# the contiguous grad buffer) from a Python hook on the parameter's AccumulateGrad node, then
# frees `param.grad`: ~30 us a parameter and backward. With the reduction not overlapped,
# the hooks do only that, and autograd's own accumulation can: when `param.grad` is the
# `main_grad` view, AccumulateGrad adds into it in place (`grad += new`, the same add).
def _unhook(nodes: list) -> bool:
    """Remove the Python hooks registered on these autograd nodes (DDP keeps no handles: a
    node's hooks share one dict, reached through a handle of one more). All or none."""
    dicts = []
    for node in nodes:
        handle = node.register_hook(lambda *_: None)
        hooks = handle.hooks_dict_ref()
        handle.remove()
        if hooks is None or len(hooks) != 1:
            return False
        dicts.append(hooks)
    for hooks in dicts:
        hooks.clear()
    return True


def _grads_in_place(ddp) -> list:
    """The parameters whose gradients can accumulate straight into `main_grad` ([] for none):
    no overlapped or delayed reduction, no fused weight-gradient kernels, grads and buffer of
    one dtype, and every hook removed."""
    cfg, config = ddp.ddp_config, ddp.config
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    if (cfg.overlap_grad_reduce or cfg.delay_wgrad_compute
            or getattr(config, "gradient_accumulation_fusion", False)
            or len(ddp.grad_accs) != len(params)
            or any(getattr(p, "is_gtp_weight_remat", False) or getattr(p, "main_grad", None) is None
                   or p.main_grad.dtype != p.dtype or p.main_grad.shape != p.shape
                   for p in params)):
        return []
    return params if _unhook(ddp.grad_accs) else []


def _apply_gradinplace() -> None:
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel as DDP

    init, forward = DDP.__init__, DDP.forward

    @functools.wraps(init)
    def init_(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.grads_in_place = _grads_in_place(self)

    @functools.wraps(forward)
    def forward_(self, *args, **kwargs):
        # every pass: the optimizer may have set the grads to None since
        for p in getattr(self, "grads_in_place", ()):
            if p.grad is not p.main_grad:
                if p.grad is not None:  # what megatron's hook would have done with it
                    p.main_grad.add_(p.grad)
                p.grad = p.main_grad
        return forward(self, *args, **kwargs)

    DDP.__init__, DDP.forward = init_, forward_


def _probe_gradinplace() -> bool:
    import inspect

    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel as DDP

    return "param.main_grad.add_(param.grad.data)" in inspect.getsource(
        DDP._make_backward_post_hook)


def _probe_gdn() -> bool:
    import importlib

    return not importlib.import_module("megatron.core.ssm.gated_delta_net.common").HAVE_FLA


SHIMS: tuple[Shim, ...] = (
    Shim("rng", "RNG tracker keeps torch.cuda states", _apply_rng,
         lambda: _raises(torch.cuda.get_rng_state)),
    Shim("curdev", "tensors placed on torch.cuda.current_device()", _apply_curdev,
         lambda: _raises(torch.cuda.current_device)),
    Shim("devcuda", "hard-coded device='cuda' / .cuda()", _apply_devcuda,
         lambda: _raises(lambda: torch.ones(1, device="cuda"))),
    Shim("stream", "CUDA streams/events in dispatcher and DDP", _apply_stream,
         lambda: _raises(torch.cuda.Stream)),
    Shim("typestr", "optimizer accepts only torch.cuda.*Tensor params", _apply_typestr,
         lambda: torch.zeros(1).type() != "torch.cuda.FloatTensor"),
    Shim("sync", "checkpoint writer calls torch.cuda.synchronize()", _apply_sync,
         lambda: _raises(torch.cuda.synchronize)),
    Shim("a2asplits", "alltoall split sizes reach gloo as tensors", _apply_a2asplits,
         _probe_a2asplits),
    Shim("adamstep", "distributed-optimizer load expects a 'step' tensor torch Adam keeps",
         _apply_adamstep, _probe_adamstep),
    Shim("gdn", "Gated DeltaNet needs flash-linear-attention (Triton)", ensure_gdn_kernels,
         _probe_gdn),
    Shim("eager", "fused helpers are torch.compile (inductor compiles C++ per shape)",
         _apply_eager, _probe_eager),
    Shim("identitysort", "MoE dispatcher copies tokens through an identity re-sort",
         _apply_identitysort, _probe_identitysort),
    Shim("rope", "unfused RoPE takes cos/sin per layer and copies its output once more",
         _apply_rope, _probe_rope),
    Shim("onerank", "gloo runs collectives over one rank on its worker thread",
         _apply_onerank, _probe_onerank),
    Shim("foreachnorm", "grad norm and clipping loop in Python per tensor without apex/TE",
         _apply_foreachnorm, _probe_foreachnorm),
    Shim("plainlinear", "parallel linears that communicate nothing run a Python autograd function",
         _apply_plainlinear, _probe_plainlinear),
    Shim("idlereset", "grad finalisation walks every module for router statistics not kept",
         _apply_idlereset, _probe_idlereset),
    Shim("gradinplace", "DDP adds each grad into main_grad from a Python hook per parameter",
         _apply_gradinplace, _probe_gradinplace),
)


def install_triton_placeholder() -> None:
    """megatron imports a triton kernel module at import time; only CUDA graphs use it."""
    if importlib.util.find_spec("triton") is not None:
        return
    mod = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
    mod.GLOBAL_BLOCK_SIZE = 1024
    mod.paged_stash_copy_kernel = mod.paged_stash_pop_kernel = None
    sys.modules[mod.__name__] = mod


def needs_shims() -> bool:
    return not torch.cuda.is_available()


def _undecorated(model=None, **_options):
    """`torch.compile` that compiles nothing: the model, or a decorator returning the function."""
    return model if model is not None else (lambda fn: fn)


def import_megatron() -> None:
    """Import megatron.core (once). Without CUDA, its import-time `torch.compile` decorations
    (megatron's `jit_fuser` on fused bias/activation helpers) leave those functions as they
    are: wrapping them imports torch._dynamo, about 1 s of every process that imports
    megatron, and the "eager" shim runs them eagerly anyway."""
    if "megatron.core" in sys.modules:
        return
    if not needs_shims():
        import megatron.core
        return
    install_triton_placeholder()
    compile_ = torch.compile
    torch.compile = _undecorated
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_


def apply() -> list[str]:
    """Apply every shim once (idempotent); a no-op when CUDA is present."""
    if not needs_shims() or APPLIED:
        return APPLIED
    import_megatron()
    for shim in SHIMS:
        shim.apply()
        APPLIED.append(shim.name)
    return APPLIED
