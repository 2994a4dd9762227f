"""HF ⇄ Megatron weight mapping, one table per architecture.

The Megatron side is named by *checkpoint keys* (what `sharded_state_dict()` saves), not by
module paths: those keys are the same for every TP/PP/EP layout and for the local and
Transformer-Engine layer specs, and per-layer / per-expert tensors are stacked on leading axes
(`decoder.layers.<key>` has a layer axis; routed experts add an expert axis). A Megatron tensor
here is the canonical TP1 tensor of one (layer[, expert]); TP/EP slicing is done by megatron's
own sharding metadata, so this table is used unchanged by offline conversion, by loading HF
weights into a running model at any layout, and by weight sync into rollout engines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from megatron_rl.checkpoint.errors import WeightMapError
from megatron_rl.models.registry import ModelSpec

HfGetter = Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class Entry:
    key: str                    # megatron checkpoint key
    hf: tuple[str, ...]         # HF templates; {l} layer, {e} expert
    kind: str                   # copy | qkv | gate_up
    stack: int = 0              # leading stacked axes: 0 none, 1 layer, 2 layer+expert

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> list[str]:
        return [t.format(l=layer, e=expert) for t in self.hf]


class WeightMap:
    """The mapping for one registry entry (Qwen3 dense and Qwen3-MoE layouts)."""

    def __init__(self, spec: ModelSpec):
        if spec.architecture not in ("qwen3", "qwen3_moe"):
            raise WeightMapError(
                f"no HF⇄Megatron weight map for architecture '{spec.architecture}' "
                f"(model '{spec.name}'); supported: qwen3, qwen3_moe")
        self.spec = spec
        L, A = "model.layers.{l}.", "decoder.layers."
        entries = [
            Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy"),
            Entry("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"),
            Entry(A + "self_attention.linear_qkv.layer_norm_weight",
                  (L + "input_layernorm.weight",), "copy", 1),
            Entry(A + "self_attention.linear_qkv.weight",
                  tuple(L + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv", 1),
            Entry(A + "self_attention.linear_proj.weight", (L + "self_attn.o_proj.weight",),
                  "copy", 1),
            Entry(A + "mlp.linear_fc1.layer_norm_weight",
                  (L + "post_attention_layernorm.weight",), "copy", 1),
        ]
        if spec.qk_layernorm:
            entries += [
                Entry(A + "self_attention.q_layernorm.weight", (L + "self_attn.q_norm.weight",),
                      "copy", 1),
                Entry(A + "self_attention.k_layernorm.weight", (L + "self_attn.k_norm.weight",),
                      "copy", 1),
            ]
        if spec.is_moe:
            E = L + "mlp.experts.{e}."
            entries += [
                Entry(A + "mlp.router.weight", (L + "mlp.gate.weight",), "copy", 1),
                Entry(A + "mlp.experts.experts.linear_fc1.weight",
                      (E + "gate_proj.weight", E + "up_proj.weight"), "gate_up", 2),
                Entry(A + "mlp.experts.experts.linear_fc2.weight", (E + "down_proj.weight",),
                      "copy", 2),
            ]
        else:
            entries += [
                Entry(A + "mlp.linear_fc1.weight",
                      (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), "gate_up", 1),
                Entry(A + "mlp.linear_fc2.weight", (L + "mlp.down_proj.weight",), "copy", 1),
            ]
        if not spec.tie_word_embeddings:
            entries.append(Entry("output_layer.weight", ("lm_head.weight",), "copy"))
        self.entries = {e.key: e for e in entries}

    # -- enumeration ---------------------------------------------------------------------------
    def entry(self, key: str) -> Entry:
        try:
            return self.entries[key]
        except KeyError:
            raise WeightMapError(f"megatron tensor '{key}' has no HF counterpart in the "
                                 f"'{self.spec.architecture}' weight map") from None

    def units(self) -> Iterator[tuple[Entry, tuple[int, ...]]]:
        """Every (entry, stacked index) in HF file order: embeddings, layer by layer, head."""
        flat = [e for e in self.entries.values() if e.stack == 0]
        yield from ((e, ()) for e in flat if e.key.startswith("embedding"))
        for layer in range(self.spec.num_layers):
            for e in self.entries.values():
                if e.stack == 1:
                    yield e, (layer,)
                elif e.stack == 2:
                    for expert in range(self.spec.num_experts):
                        yield e, (layer, expert)
        yield from ((e, ()) for e in flat if not e.key.startswith("embedding"))

    def hf_names(self) -> list[str]:
        return [n for e, idx in self.units() for n in e.hf_names(*idx)]

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        s = self.spec
        h, d = s.hidden_size, s.head_dim
        shapes: dict[str, tuple[int, ...]] = {}
        per = {
            "embed_tokens.weight": (s.vocab_size, h), "lm_head.weight": (s.vocab_size, h),
            "model.norm.weight": (h,), "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "q_proj.weight": (s.num_attention_heads * d, h),
            "k_proj.weight": (s.num_query_groups * d, h),
            "v_proj.weight": (s.num_query_groups * d, h),
            "o_proj.weight": (h, s.num_attention_heads * d),
            "q_norm.weight": (d,), "k_norm.weight": (d,), "gate.weight": (s.num_experts, h),
        }
        ffn = s.moe_ffn_hidden_size if s.is_moe else s.ffn_hidden_size
        per.update({"gate_proj.weight": (ffn, h), "up_proj.weight": (ffn, h),
                    "down_proj.weight": (h, ffn)})
        for name in self.hf_names():
            suffix = next(k for k in per if name.endswith(k))
            shapes[name] = per[suffix]
        return shapes

    # -- conversion ----------------------------------------------------------------------------
    def to_megatron(self, entry: Entry, index: tuple[int, ...], get: HfGetter) -> torch.Tensor:
        """The canonical (TP1) Megatron tensor of `entry` at `index` from HF tensors."""
        parts = [get(n) for n in entry.hf_names(*index)]
        if entry.kind == "copy":
            return parts[0]
        if entry.kind == "gate_up":
            return torch.cat(parts, dim=0)
        q, k, v = parts
        s = self.spec
        groups, d = s.num_query_groups, s.head_dim
        per_group = s.num_attention_heads // groups
        q = q.view(groups, per_group * d, -1)
        k, v = k.view(groups, d, -1), v.view(groups, d, -1)
        return torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])

    def to_hf(self, entry: Entry, index: tuple[int, ...],
              tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        names = entry.hf_names(*index)
        if entry.kind == "copy":
            return {names[0]: tensor}
        if entry.kind == "gate_up":
            gate, up = tensor.chunk(2, dim=0)
            return {names[0]: gate, names[1]: up}
        s = self.spec
        groups, d = s.num_query_groups, s.head_dim
        per_group = s.num_attention_heads // groups
        qkv = tensor.view(groups, (per_group + 2) * d, -1)
        q, k, v = qkv.split([per_group * d, d, d], dim=1)
        return {names[0]: q.reshape(-1, qkv.shape[-1]), names[1]: k.reshape(-1, qkv.shape[-1]),
                names[2]: v.reshape(-1, qkv.shape[-1])}
