"""Tokens/s and MFU of a Megatron train step on a slice of a real MoE architecture.

A few layers (default: 2 of qwen3-30b-a3b, 4 of qwen3.5-35b-a3b so one gated full-attention
layer sits among its Gated DeltaNet ones; the MTP block left out) at the full width, bf16, one
rank. Timed: forward + backward inside megatron's schedule (the optimizer step is not counted).
MFU = model FLOPs per token × tokens/s / the GPU's dense bf16 peak (by device name: H100/H200
989 TFLOP/s, H20 148, A100 312, B200 2250); FLOPs per token = 3 × forward (matmuls, causal
attention scores, the delta-rule state update, the logits), active experts only.

    python benchmarks/mfu.py [--models qwen3-30b-a3b qwen3.5-35b-a3b] [--seq 4096] [--batch 2]
        [--steps 4] [--fp8 delayed|blockwise|mxfp8] [--json OUT]
    python benchmarks/mfu.py --tiny      # CPU: tiny-moe / tiny-qwen3.5, a few tokens (no MFU)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# dense bf16 tensor-core peak, FLOP/s (no sparsity), by a substring of the device name
PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("H20", 148e12),
             ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12))
DEFAULT_LAYERS = {"qwen3-30b-a3b": 2, "qwen3.5-35b-a3b": 4, "tiny-moe": 2, "tiny-qwen3.5": 4}


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by name (longest match first: 'H200' before 'H20')."""
    for key, peak in sorted(PEAK_BF16, key=lambda kv: -len(kv[0])):
        if key in device_name:
            return peak
    return None


def flops_per_token(spec: Any, seq: int) -> float:
    """Training FLOPs per token (3 × forward) of `spec`'s layers at sequence length `seq`."""
    h, d = spec.hidden_size, spec.head_dim
    fwd = 0.0
    for kind in spec.layer_types:
        if kind == "linear_attention":
            la = spec.linear_attention
            k, v = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
            proj = h * (2 * k + v) + h * v + 2 * h * la.num_value_heads + v * h
            # delta rule per token and head: state decay/update and readout, ~4 dk·dv each
            fwd += 2 * proj + 4 * la.num_value_heads * la.key_head_dim * la.value_head_dim
        else:
            q = spec.num_attention_heads * d * (2 if spec.attention_output_gate else 1)
            proj = h * q + 2 * h * spec.num_query_groups * d + spec.num_attention_heads * d * h
            # QK^T and AV over the causal half of the sequence on average
            fwd += 2 * proj + 2 * spec.num_attention_heads * d * seq
        if spec.is_moe:
            mlp = spec.moe_router_topk * 3 * h * spec.moe_ffn_hidden_size + h * spec.num_experts
            if spec.shared_expert_ffn_hidden_size:
                mlp += 3 * h * spec.shared_expert_ffn_hidden_size
        else:
            mlp = 3 * h * spec.ffn_hidden_size
        fwd += 2 * mlp
    fwd += 2 * h * spec.vocab_size  # the logits
    return 3 * fwd


def measure(name: str, layers: int, seq: int, batch: int, steps: int, warmup: int,
            dtype: str, fp8: str | None) -> dict[str, Any]:
    from megatron_rl.config.loader import load_config
    from megatron_rl.distributed.process_groups import init_distributed
    from megatron_rl.models.builder import use_transformer_engine
    from megatron_rl.models.registry import get_model_spec
    from megatron_rl.records.batch import TokenBatch
    from megatron_rl.trainer.actor import MegatronActor
    from megatron_rl.trainer.losses import lm_loss

    spec = dataclasses.replace(get_model_spec(name), num_layers=layers, mtp_num_layers=0)
    init_distributed("auto")
    overrides = [f"model.name={name}", f"model.seq_length={seq}", f"model.dtype={dtype}",
                 f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}",
                 "optim.lr=1e-5", "train.logprob_chunk_tokens=8192"]
    if fp8:
        overrides.append(f"model.fp8={fp8}")
    cfg = load_config(None, overrides)
    actor = MegatronActor(cfg, spec)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (batch, seq + 1), generator=g)
    data = TokenBatch.from_sequences(tokens)
    times, losses = [], []
    for i in range(warmup + steps):
        before = actor.forward_backward_seconds
        losses.append(actor.train_step(data, lm_loss)["loss"])
        if i >= warmup:
            times.append(actor.forward_backward_seconds - before)
    seconds = statistics.median(times)
    tps = batch * seq / seconds
    per_token = flops_per_token(spec, seq)
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_flops(device) if cuda else None
    achieved = per_token * tps
    params = sum(p.numel() for p in actor.parameters().values())
    out = {"model": name, "layers": layers, "layer_types": spec.layer_types, "seq": seq,
           "batch": batch, "dtype": dtype, "fp8": fp8, "device": device,
           "transformer_engine": use_transformer_engine(cfg.model), "params": params,
           "fwd_bwd_s": seconds, "tokens_per_s": tps, "flops_per_token": per_token,
           "achieved_tflops": achieved / 1e12, "peak_tflops": peak / 1e12 if peak else None,
           "mfu": achieved / peak if peak else None, "losses": losses,
           "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    del actor
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=None)
    p.add_argument("--layers", type=int, default=0, help="default: per model (see above)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--fp8", choices=("delayed", "blockwise", "mxfp8"), default=None)
    p.add_argument("--tiny", action="store_true",
                   help="CPU-sized: tiny-moe and tiny-qwen3.5, seq 32, fp32 (no MFU)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    from megatron_rl.utils.logs import quiet_libraries

    quiet_libraries()
    if args.tiny:
        models, seq, batch, dtype = args.models or ["tiny-moe", "tiny-qwen3.5"], 32, 2, "fp32"
        steps, warmup = min(args.steps, 2), 1
    else:
        models = args.models or ["qwen3-30b-a3b", "qwen3.5-35b-a3b"]
        seq, batch, steps, warmup = args.seq, args.batch, args.steps, args.warmup
        dtype = "bf16"
    rows = []
    for name in models:
        r = measure(name, args.layers or DEFAULT_LAYERS.get(name, 2), seq, batch, steps,
                    warmup, dtype, args.fp8)
        rows.append(r)
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a (no known peak)"
        print(f"[mfu] {name} x{r['layers']} layers ({r['device']}, {dtype}"
              f"{', fp8 ' + args.fp8 if args.fp8 else ''}, TE {r['transformer_engine']}): "
              f"{r['tokens_per_s']:,.0f} tokens/s, {r['achieved_tflops']:.1f} TFLOP/s, "
              f"MFU {mfu}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
