"""Each CPU shim fixes a failure that still happens without it (checked in a clean process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megatron_rl.models import cpu_compat

PROBE = """
import json, torch
from megatron_rl.models import cpu_compat
print(json.dumps({s.name: bool(s.probe()) for s in cpu_compat.SHIMS}))
"""


def test_every_shim_is_still_needed():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    needed = json.loads(out)
    assert set(needed) == {s.name for s in cpu_compat.SHIMS}
    stale = [name for name, still in needed.items() if not still]
    assert not stale, f"upstream fixed these; delete their shims: {stale}"


def test_apply_is_idempotent_and_cpu_only():
    script = ("from megatron_rl.models import cpu_compat as c; a = list(c.apply()); "
              "b = list(c.apply()); print(a == b, len(a))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", str(len(cpu_compat.SHIMS))] or torch.cuda.is_available()
    assert cpu_compat.needs_shims() == (not torch.cuda.is_available())


def test_megatron_imports_without_wrapping_its_helpers_in_torch_compile():
    """`import_megatron` on a CPU: megatron's fused helpers stay plain functions, torch._dynamo
    is never imported, and torch.compile is torch's own again afterwards."""
    script = ("import sys, torch; real = torch.compile; "
              "from megatron_rl.models import cpu_compat as c; c.import_megatron(); "
              "import megatron.core.jit as j; "
              "from megatron.core.fusions.fused_bias_swiglu import bias_swiglu; "
              "print('torch._dynamo' in sys.modules, torch.compile is real, "
              "j.jit_fuser is c._undecorated, type(bias_swiglu).__name__)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True", "True", "function"] or torch.cuda.is_available()


def test_cuda_tensor_module_list_covers_megatron():
    """Every megatron module on CPU paths that calls torch.tensor(..., device='cuda') is listed."""
    import importlib.util
    from pathlib import Path

    root = Path(importlib.util.find_spec("megatron.core").origin).parent
    found = {"megatron." + ".".join(p.relative_to(root.parent).with_suffix("").parts)
             for p in root.rglob("*.py") if cpu_compat.CUDA_TENSOR_CALL.search(
                 p.read_text(errors="ignore"))}
    gpu_only = ("inference", "fsdp", "nvshmem", "energy_monitor", "mimo")
    expected = {m for m in found if not any(part in m for part in gpu_only)}
    assert expected == set(cpu_compat.TORCH_TENSOR_CUDA_MODULES)


HF_LOGITS = """
import sys, torch
sys.path.insert(0, ".")
if sys.argv[3] == "shims":
    from megatron_rl.models import cpu_compat
    cpu_compat.apply()
from tests import conversion_cases as cc
torch.save(cc.hf_logits(sys.argv[1], cc.tokens(512)), sys.argv[2])
"""


def test_transformers_unaffected_by_shims(tmp_path):
    """A transformers model first used after the shims computes what it computes without them
    (a global torch.tensor wrapper once changed Qwen3-MoE logits by ~1)."""
    from tests import conversion_cases as cc

    hf = tmp_path / "hf"
    cc.save_random_hf("tiny-moe", str(hf))
    out = {}
    for mode in ("plain", "shims"):  # fresh processes alike (threads, imports): only the shims
        path = tmp_path / f"{mode}.pt"  # differ
        subprocess.run([sys.executable, "-c", HF_LOGITS, str(hf), str(path), mode], check=True,
                       capture_output=True)
        out[mode] = torch.load(path, weights_only=True)
    assert torch.equal(out["shims"], out["plain"])


def test_one_rank_collectives_and_grad_norms_as_torch_and_megatron_compute_them():
    from tests import dist_cases
    from tests.pools import get_pool

    out = get_pool(1).run(dist_cases.one_rank_collectives)[0]
    assert out["returns"] == [None, None, None] and out["values"] == [0.0, 1.0, 2.0, 3.0]
    assert out["work"] and out["norm_equal"] and out["scaled_equal"] and out["linear_equal"]
    assert out["reset_after"] == [3.0, 0.0] and out["mappings_pass_through"]


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-qwen3.5"])
def test_single_rank_moe_layer_is_megatrons_dispatcher_bit_for_bit(model):
    """The MoE layer's single-rank path (aux loss on; tiny-qwen3.5 adds a gated shared
    expert) gives the all-to-all dispatcher's loss and gradients exactly."""
    from tests import dist_cases
    from tests.pools import get_pool

    out = get_pool(1).run(dist_cases.single_rank_moe_against_dispatcher, model)[0]
    assert out["layers"] >= 2 and all(out["direct"])
    assert out["metrics_equal"] and out["grads_equal"] and out["router_grad_nonzero"]
    assert 4.0 < out["loss"] < 9.0


def test_short_softmax_router_routes_as_megatrons_router():
    """The local spec's router: the experts megatron's router picks, its probabilities and
    gradients (aux loss included) within float32 rounding, before or after the top-k."""
    from tests import dist_cases
    from tests.pools import get_pool

    out = get_pool(1).run(dist_cases.short_softmax_router_against_megatrons)[0]
    assert out["eligible"] and len(out["cases"]) == 4
    for case in out["cases"]:
        assert case["maps_equal"], case
        assert case["probs_diff"] < 1e-6, case
        assert case["grad_diff"] < 1e-6 * case["grad_size"] + 1e-7, case
        assert case["grad_size"] > 1e-3, case


def test_grads_accumulate_into_main_grad_as_ddp_hooks_add_them():
    """The gradinplace shim: autograd accumulates two micro-batches straight into the DDP
    grad buffer; megatron's hooks on the same actor give the same buffer bit for bit."""
    from tests import dist_cases
    from tests.pools import get_pool

    out = get_pool(1).run(dist_cases.grads_in_place_against_ddp_hooks)[0]
    assert out["params"] > 20 and out["all"] and out["aliased"] == out["params"]
    assert out["metrics_equal"] and out["grads_equal"]
    assert out["nonzero"] >= out["params"] - 2  # (an expert may get no token)


def _outputs_and_grads(fns, inputs: list[torch.Tensor], upstream: torch.Tensor) -> list[list]:
    """Per function: its output and the gradients of fresh copies of `inputs` after a
    backward from `upstream`."""
    runs = []
    for fn in fns:
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        out.backward(upstream)
        runs.append([out.detach(), *(t.grad for t in leaves)])
    return runs


def _assert_same_bits(runs: list[list]) -> None:
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert all(t.abs().sum() > 0 for t in runs[0])


def test_rope_backward_writes_autograds_values_bit_for_bit():
    """The rope shim's function: output and gradient exactly those of autograd through the
    ops it replaces (halves of the last dim negated, chunked, concatenated), with a
    non-contiguous incoming gradient as attention's."""
    cpu_compat.import_megatron()
    from megatron.core.models.common.embeddings import rope_utils

    g = torch.Generator().manual_seed(0)
    t0 = torch.randn(12, 2, 3, 16, generator=g)
    freqs = torch.rand(12, 1, 1, 16, generator=g) * 6
    upstream = torch.randn(2, 12, 3, 16, generator=g).transpose(0, 1)  # strided like q's
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    _assert_same_bits(_outputs_and_grads(
        (lambda t: cpu_compat._Rope.apply(t, cos, sin),
         lambda t: t * cos + rope_utils._rotate_half(t, False) * sin), [t0], upstream))


@pytest.mark.parametrize("shape", [(64, 32), (12, 2, 3, 16), (30, 48)])
def test_local_rmsnorm_is_torchs_rms_norm_bit_for_bit(shape):
    """The local spec's RMSNorm (one autograd node): output and both gradients exactly those of
    autograd through torch's rms_norm, for a power-of-two width and another."""
    from megatron_rl.models.layer_specs import _RMSNorm

    g = torch.Generator().manual_seed(0)
    x0, upstream = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    w0 = torch.rand(shape[-1], generator=g) + 0.5
    _assert_same_bits(_outputs_and_grads(
        (lambda x, w: _RMSNorm.apply(x, w, 1e-6),
         lambda x, w: torch.nn.functional.rms_norm(x, w.shape, w, 1e-6)), [x0, w0], upstream))


@pytest.mark.parametrize("shape", [(4096, 64), (37, 48)])
def test_grouped_experts_gate_node_is_autograds_composite_bit_for_bit(shape):
    """The grouped experts' silu(gate) * up * probs (one autograd node, both halves' gradients
    in one tensor): output and the gradients of [gate | up] and of the probabilities exactly
    those of autograd through chunk, silu and the two products."""
    from megatron_rl.models.layer_specs import _SiluGateTimesProbs

    rows, half = shape
    g = torch.Generator().manual_seed(rows)
    fused0 = torch.randn(rows, 2 * half, generator=g) * 3
    probs0, upstream = torch.rand(rows, generator=g), torch.randn(rows, half, generator=g)

    def composite(fused, probs):
        gate, up = fused.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up * probs.unsqueeze(-1)

    _assert_same_bits(_outputs_and_grads((_SiluGateTimesProbs.apply, composite),
                                         [fused0, probs0], upstream))
