"""The Qwen3-MoE-layout registry entry the benchmarks generate, sized from their flags."""

from __future__ import annotations

import argparse


def add_size_args(p: argparse.ArgumentParser, layers: int, hidden: int, experts: int) -> None:
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--experts", type=int, default=experts)
    p.add_argument("--vocab", type=int, default=32000)


def spec_yaml(a: argparse.Namespace) -> str:
    return f"""architecture: qwen3_moe
hidden_size: {a.hidden}
num_layers: {a.layers}
num_attention_heads: 8
num_query_groups: 2
head_dim: {a.hidden // 8}
ffn_hidden_size: {a.hidden * 2}
vocab_size: {a.vocab}
num_experts: {a.experts}
moe_router_topk: 2
moe_ffn_hidden_size: {a.hidden}
"""
