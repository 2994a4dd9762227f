"""Blockwise FP8 (e4m3, 128×128 blocks) HF checkpoints for SGLang engines (docs/fp8.md).

The format is the one of the official Qwen3 / DeepSeek-V3 FP8 releases, read by SGLang's `fp8`
quantization (`Fp8Config.from_config`: `quant_method`, `activation_scheme`,
`weight_block_size`, `ignored_layers` or `modules_to_not_convert`):

  <module>.weight            torch.float8_e4m3fn, the original shape
  <module>.weight_scale_inv  float32 [ceil(rows/128), ceil(cols/128)]; dequant = fp8 × scale_inv
                             of its block (edge blocks are partial, as in those releases)

Only the big projections are converted (attention q/k/v/o, the MLP / expert / shared-expert
gate/up/down, Gated DeltaNet in_proj_qkv / in_proj_z / out_proj). What the official FP8
checkpoints keep in their original dtype stays so: embeddings, lm_head, every norm, the MoE
router (`mlp.gate`), the shared-expert gate, the Gated DeltaNet gate projections
(`in_proj_a`, `in_proj_b`), conv1d, A_log, dt_bias, and the MTP block's `fc`.

Two quantizers give the same format: nvidia-modelopt's `FP8QTensor` when it imports and CUDA is
there (the GPU extra), else the plain-torch one here (amax per block, scale = amax / 448, round
to nearest e4m3). Both are checked against the error bound before anything is written.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_rl.checkpoint.errors import HFCheckpointError

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0            # torch.finfo(torch.float8_e4m3fn).max
SCALE_SUFFIX = "_scale_inv"
# e4m3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 relative for normal values;
# below the smallest normal (2^-6 × scale) the spacing is 2^-9 × scale, so half of it absolute
REL_BOUND = 2.0 ** -4
SUBNORMAL_ABS = 2.0 ** -10

# the projections that are converted (module name suffixes, after the layer prefix)
_QUANTIZED = re.compile(
    r"(self_attn\.(q|k|v|o)_proj"
    r"|mlp\.(gate|up|down)_proj"
    r"|mlp\.experts\.\d+\.(gate|up|down)_proj"
    r"|mlp\.shared_expert\.(gate|up|down)_proj"
    r"|linear_attn\.(in_proj_qkv|in_proj_z|out_proj))\.weight")
# 2-D linear weights that stay in the original dtype (listed in modules_to_not_convert, which
# SGLang matches against its module prefixes); norms, embeddings and 1-D/3-D tensors are never
# linear layers, so they need no listing
_KEPT_LINEAR = re.compile(r"(mlp\.gate|mlp\.shared_expert_gate|linear_attn\.in_proj_(a|b)"
                          r"|linear_attn\.in_proj_ba|mtp\.fc|lm_head)\.weight")


def is_quantized_name(name: str) -> bool:
    """Whether the HF tensor `name` is stored as FP8 (its module is a converted projection)."""
    return (_QUANTIZED.search(name) is not None and name.endswith(".weight")
            and not name.startswith(("model.visual.", "visual.")))


def kept_linear_module(name: str) -> str | None:
    """The module name of a linear layer left in its dtype (for modules_to_not_convert)."""
    return name.removesuffix(".weight") if _KEPT_LINEAR.search(name) else None


def _blocks(shape: tuple[int, ...], block: int) -> tuple[int, int]:
    return math.ceil(shape[0] / block), math.ceil(shape[1] / block)


def _padded(w: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = _blocks(tuple(w.shape), block)
    out = torch.zeros(rows * block, cols * block, dtype=torch.float32, device=w.device)
    out[: w.shape[0], : w.shape[1]] = w
    return out


def _expand(scale: torch.Tensor, shape: tuple[int, ...], block: int) -> torch.Tensor:
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return full[: shape[0], : shape[1]]


def quantize_blockwise(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv per block) of a 2-D tensor; plain torch, any device."""
    if w.dim() != 2:
        raise ValueError(f"blockwise FP8 needs a 2-D weight, got shape {list(w.shape)}")
    rows, cols = _blocks(tuple(w.shape), block)
    x = _padded(w.float(), block).view(rows, block, cols, block)
    amax = x.abs().amax(dim=(1, 3))
    # an all-zero block keeps scale 1 (any scale reproduces zeros; 0 would divide by zero)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)  # fp32 rounding may pass 448
    q = q.view(rows * block, cols * block)[: w.shape[0], : w.shape[1]].to(FP8_DTYPE)
    return q.contiguous(), scale.float().contiguous()


def _quantize_modelopt(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nvidia-modelopt's FP8QTensor (same scheme: amax / 448 per block, dequant = q × scale)."""
    from modelopt.torch.quantization.qtensor import FP8QTensor

    x = w.float().cuda()
    sizes = {-1: block, -2: block}
    qt, scale = FP8QTensor.quantize(x, block_sizes=sizes)
    if bool((scale == 0).any()):  # an all-zero block: give it scale 1 as the torch path does
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        qt, scale = FP8QTensor.quantize(x, scales=scale, block_sizes=sizes)
    return qt._quantized_data.cpu().contiguous(), scale.reshape(_blocks(tuple(w.shape), block)
                                                               ).float().cpu().contiguous()


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor,
                         block: int = BLOCK) -> torch.Tensor:
    """float32 weight of an FP8 weight and its per-block scale_inv."""
    expected = _blocks(tuple(q.shape), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv has shape {list(scale_inv.shape)}, expected "
                         f"{list(expected)} for a {list(q.shape)} weight in {block}-blocks")
    return q.float() * _expand(scale_inv.float(), tuple(q.shape), block)


def error_bound(w: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Per-element bound of |dequant - w|: 1/16 relative, plus half a subnormal step."""
    s = _expand(scale_inv.float(), tuple(w.shape), block)
    return w.float().abs() * REL_BOUND + s * SUBNORMAL_ABS + 1e-12


def normal_relative_error(w: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
                          block: int = BLOCK) -> float:
    """Largest |dequant - w| / |w| over the elements in e4m3's normal range (|w| / scale >=
    2^-6): the figure the 1/16 bound is about (smaller values have an absolute bound)."""
    s = _expand(scale_inv.float(), tuple(w.shape), block)
    normal = w.float().abs() >= s * 2.0 ** -6
    if not bool(normal.any()):
        return 0.0
    err = (dequantize_blockwise(q, scale_inv, block) - w.float()).abs()
    return float((err[normal] / w.float().abs()[normal]).max())


def choose_backend(backend: str = "auto") -> str:
    """'modelopt' (nvidia-modelopt importable and CUDA present) or 'torch'."""
    if backend not in ("auto", "torch", "modelopt"):
        raise ValueError(f"backend={backend!r}: choose auto, torch or modelopt")
    if backend == "torch":
        return "torch"
    try:
        import modelopt.torch.quantization.qtensor  # noqa: F401
        ok = torch.cuda.is_available()
    except ImportError:
        ok = False
    if backend == "modelopt" and not ok:
        raise RuntimeError("backend=modelopt needs nvidia-modelopt and CUDA (the `gpu` extra); "
                           "backend=torch runs the same blockwise scheme on CPU")
    return "modelopt" if ok else "torch"


def quantize_tensor(name: str, w: torch.Tensor, block: int = BLOCK,
                    backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """A checked blockwise quantization of tensor `name`: errors name the tensor."""
    if w.dim() != 2:
        raise HFCheckpointError(f"tensor {name}: shape {list(w.shape)} is not a 2-D "
                                "projection weight; FP8 blocks need one")
    if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise HFCheckpointError(f"tensor {name} is already {w.dtype}: the source must be a "
                                "bf16/fp16/fp32 checkpoint")
    if not w.is_floating_point():
        raise HFCheckpointError(f"tensor {name}: dtype {w.dtype} is not a float type")
    if not bool(torch.isfinite(w).all()):
        raise HFCheckpointError(f"tensor {name} holds non-finite values (inf/nan): no FP8 "
                                "scale represents them")
    q, s = (_quantize_modelopt if backend == "modelopt" else quantize_blockwise)(w, block)
    err = (dequantize_blockwise(q, s, block) - w.float()).abs()
    if bool((err > error_bound(w, s, block)).any()):
        raise HFCheckpointError(f"tensor {name}: the {backend} quantizer exceeded the e4m3 "
                                f"error bound (max error {err.max().item():.3g})")
    return q, s


def quantize_named(named: Iterable[tuple[str, torch.Tensor]], block: int = BLOCK,
                   backend: str = "torch") -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors with every converted projection replaced by its FP8 weight followed by
    its `weight_scale_inv` (so a bucket holds both); everything else unchanged."""
    for name, t in named:
        if is_quantized_name(name):
            q, s = quantize_tensor(name, t, block, backend)
            yield name, q
            yield name + SCALE_SUFFIX, s
        else:
            yield name, t


def dequantize_named(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
                     block: int = BLOCK) -> list[tuple[str, torch.Tensor]]:
    """The inverse for a receiver that keeps high-precision weights: each FP8 weight with its
    scale_inv (in the same list) becomes one `dtype` tensor. A scale without its weight, or an
    FP8 weight without its scale, is an error naming it."""
    scales = {n.removesuffix(SCALE_SUFFIX): t for n, t in named if n.endswith(SCALE_SUFFIX)}
    out = []
    for name, t in named:
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in {n for n, _ in named}:
                raise ValueError(f"tensor '{name}': a scale without its weight in the bucket")
            continue
        if t.dtype == FP8_DTYPE:
            if name not in scales:
                raise ValueError(f"tensor '{name}' is FP8 but '{name}{SCALE_SUFFIX}' is not in "
                                 "the bucket")
            w = dequantize_blockwise(t, scales[name], block)
            out.append((name, w.to(dtype) if dtype is not None else w))
        else:
            out.append((name, t))
    return out


def quantization_config(not_converted: list[str], block: int = BLOCK) -> dict[str, Any]:
    """config.json's `quantization_config`, as in Qwen3-*-FP8 (plus the exclusions listed)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [block, block], "modules_to_not_convert": not_converted}


# ---------------------------------------------------------------------------------------------
# a whole HF folder
# ---------------------------------------------------------------------------------------------


def quantize_hf_checkpoint(src: str | Path, out: str | Path, model: str | None = None, *,
                           block: int = BLOCK, backend: str = "auto",
                           max_shard_bytes: int = 2 << 30, overwrite: bool = False,
                           progress: bool = True) -> dict[str, Any]:
    """An HF folder (bf16/fp32) → its blockwise-FP8 twin `out`, one tensor in memory at a time.

    The source is checked against its architecture first (tensor set and shapes: an error
    names the first missing / unexpected tensor). Routed experts are written per expert (the
    FP8 releases' layout) whatever the source's layout. Written to a temp folder next to `out`
    and renamed into place: a failing run leaves neither `out` nor the temp folder."""
    from tqdm import tqdm

    from megatron_rl.checkpoint.hf_io import (
        INDEX,
        SINGLE,
        VL_TEXT_PREFIX,
        HFCheckpoint,
        ShardedSafetensorsWriter,
    )
    from megatron_rl.checkpoint.weight_map import WeightMap
    from megatron_rl.models.registry import HF_CLASSES, get_model_spec, spec_from_hf

    t0 = time.time()
    src, out = Path(src), Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite to replace it)")
    used = choose_backend(backend)
    spec = get_model_spec(model) if model else spec_from_hf(src)
    wmap = WeightMap(spec)
    hf = HFCheckpoint(src)
    if "quantization_config" in hf.config:
        method = hf.config["quantization_config"]
        method = method.get("quant_method") if isinstance(method, dict) else method
        raise HFCheckpointError(f"{hf.config_path}: already quantized (quantization_config "
                                f"{method!r}); the source must be a bf16/fp16/fp32 checkpoint")
    vl = ("Qwen3_5MoeForConditionalGeneration",) if spec.architecture == "qwen3_5_moe" else ()
    layout = hf.check(wmap, (HF_CLASSES[spec.architecture][1], *vl))
    stored_vl = any(stored.startswith(VL_TEXT_PREFIX) for _, stored in hf.weight_map.values())

    def stored_name(plain: str) -> str:
        return VL_TEXT_PREFIX + plain[len("model."):] if stored_vl and plain.startswith(
            "model.") else plain

    names = wmap.hf_names()
    if spec.tie_word_embeddings:
        names = [n for n in names if n != "lm_head.weight"]
    mapped = set(names) | {f for f, _ in (layout.source(n) or (None, None) for n in names) if f}
    extras = [n for n in hf.names() if n not in mapped]  # the vision tower, MTP of a no-MTP spec

    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts = {"fp8": 0, "kept": 0}
    not_converted: list[str] = []
    worst = 0.0
    try:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
        bar = tqdm(total=len(names) + len(extras), desc="fp8", unit="tensor",
                   disable=not progress)
        for name in names + extras:
            fused = layout.source(name) if name in names else None
            t = hf.get(name) if fused is None else hf.get_slice(*fused)
            if is_quantized_name(name):
                q, s = quantize_tensor(name, t, block, used)
                worst = max(worst, normal_relative_error(t, q, s, block))
                writer.add(stored_name(name), q)
                writer.add(stored_name(name) + SCALE_SUFFIX, s)
                counts["fp8"] += 1
            else:
                if (module := kept_linear_module(name)) is not None:
                    not_converted.append(stored_name(module + ".weight").removesuffix(".weight"))
                writer.add(stored_name(name), t)
                counts["kept"] += 1
            bar.update(1)
        bar.close()
        files = writer.close()
        config = dict(hf.config)
        config["quantization_config"] = quantization_config(not_converted, block)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        skip = {"config.json", SINGLE, INDEX}
        for f in src.iterdir():  # tokenizer, chat template, generation config
            if f.is_file() and f.name not in skip and not f.name.endswith(".safetensors"):
                shutil.copy2(f, tmp / f.name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.time() - t0
    return {"files": files, "backend": used, "fp8_tensors": counts["fp8"],
            "kept_tensors": counts["kept"], "modules_to_not_convert": not_converted,
            "bytes": writer.total_bytes, "seconds": seconds,
            "max_normal_relative_error": worst}
