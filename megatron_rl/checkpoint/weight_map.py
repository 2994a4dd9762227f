"""HF ⇄ Megatron weight mapping, one table per architecture.

The Megatron side is named by *checkpoint keys* (what `sharded_state_dict()` saves), not by
module paths: those keys are the same for every TP/PP/EP layout and for the local and
Transformer-Engine layer specs (TE's grouped-GEMM experts save under the same keys as the
local SequentialMLP), and per-layer / per-expert tensors are stacked on leading axes
(`decoder.layers.<key>` has a layer axis; routed experts add an expert axis). A Megatron tensor
here is the canonical TP1 tensor of one (layer[, expert]); TP/EP slicing is done by megatron's
own sharding metadata, so this table is used unchanged by offline conversion (both ways) and
by weight sync into rollout engines.

An `Entry` ties one group of Megatron keys to one group of HF tensors:
  copy       1 key ⇄ 1 tensor
  gate_up    1 key (fc1) ⇄ gate_proj, up_proj                       (stacked on dim 0)
  qkv        1 key (linear_qkv) ⇄ q, k, v                           (interleaved per GQA group)
  gated_qkv  as qkv, but q_proj carries the output gate per head (Qwen3.5 gated attention)
  split      N keys (GDN in_proj / conv1d sections) ⇄ 1 tensor       (stacked on dim 0)

The table speaks per-expert HF names (`mlp.experts.{e}.gate_proj.weight`), which is what
`save_pretrained` writes and what weight sync sends to engines. An HF *file* may instead store
a routed-expert group fused (`HfLayout`); that is a storage layout translated at the file
boundary (import reads slices, export packs), so the table and weight sync never see it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl.checkpoint.errors import WeightMapError
from megatron_rl.models.registry import ModelSpec

HfGetter = Callable[[str], torch.Tensor]
SUPPORTED = ("qwen3", "qwen3_moe", "qwen3_5_moe")
_LAYER_KEY = re.compile(r"(decoder|mtp)\.layers\.(\d+)\.(.*)")
PER_EXPERT, FUSED = "per_expert", "fused"
EXPERT_LAYOUTS = (PER_EXPERT, FUSED)
# a per-expert HF name: group, expert, projection
_PER_EXPERT_NAME = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


@dataclass(frozen=True)
class Entry:
    keys: tuple[str, ...]       # megatron checkpoint keys; {l} layer when layers are not stacked
    hf: tuple[str, ...]         # HF templates; {l} layer, {e} expert
    kind: str = "copy"
    stack: int = 0              # logical index: 0 none, 1 (layer), 2 (layer, expert)
    layer_type: str | None = None  # only layers of this type ('linear_attention', ...)

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> list[str]:
        return [t.format(l=layer, e=expert) for t in self.hf]


def _applies(entry: Entry, kind: str) -> bool:
    """Whether `entry` exists in a layer of `kind` (a decoder layer type, or 'mtp')."""
    if kind == "mtp":
        return entry.layer_type == "mtp"
    return entry.layer_type in (None, kind)


class WeightMap:
    """The mapping for one registry entry (Qwen3, Qwen3-MoE, Qwen3.5 hybrid MoE)."""

    def __init__(self, spec: ModelSpec):
        if spec.architecture not in SUPPORTED:
            raise WeightMapError(
                f"no HF⇄Megatron weight map for architecture '{spec.architecture}' "
                f"(model '{spec.name}'); supported: {', '.join(SUPPORTED)}")
        self.spec = spec
        # megatron stacks per-layer tensors on a layer axis only when all layers are alike;
        # the hybrid's checkpoint has one key per layer (`decoder.layers.<i>.…`)
        self.stacked_layers = spec.linear_attention is None
        L = "model.layers.{l}."
        A = "decoder.layers." if self.stacked_layers else "decoder.layers.{l}."
        entries = [
            Entry(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",)),
            Entry(("decoder.final_layernorm.weight",), ("model.norm.weight",)),
        ]
        hybrid = spec.linear_attention is not None
        entries += self._layer_entries(L, A, "full_attention" if hybrid else None)
        if hybrid:
            entries += self._gated_deltanet_entries(L, A)
        if spec.mtp_num_layers:
            entries += self._mtp_entries()
        if not spec.tie_word_embeddings:
            entries.append(Entry(("output_layer.weight",), ("lm_head.weight",)))
        self.entries = entries
        self._by_key = {k: (e, i) for e in entries for i, k in enumerate(e.keys)}

    def _layer_entries(self, L: str, A: str, attention: str | None) -> list[Entry]:
        """Full attention (entries tagged `attention`) and the MLP / MoE of one layer."""
        spec = self.spec
        mlp = "mtp" if attention == "mtp" else None
        entries = [
            Entry((A + "self_attention.linear_qkv.layer_norm_weight",),
                  (L + "input_layernorm.weight",), stack=1, layer_type=attention),
            Entry((A + "self_attention.linear_qkv.weight",),
                  tuple(L + f"self_attn.{p}_proj.weight" for p in "qkv"),
                  "gated_qkv" if spec.attention_output_gate else "qkv", 1, attention),
            Entry((A + "self_attention.linear_proj.weight",), (L + "self_attn.o_proj.weight",),
                  stack=1, layer_type=attention),
        ]
        if spec.qk_layernorm:
            entries += [Entry((A + f"self_attention.{p}_layernorm.weight",),
                              (L + f"self_attn.{p}_norm.weight",), stack=1, layer_type=attention)
                        for p in "qk"]
        if not spec.is_moe:
            return [
                *entries,
                Entry((A + "mlp.linear_fc1.layer_norm_weight",),
                      (L + "post_attention_layernorm.weight",), stack=1, layer_type=mlp),
                Entry((A + "mlp.linear_fc1.weight",),
                      (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), "gate_up", 1, mlp),
                Entry((A + "mlp.linear_fc2.weight",), (L + "mlp.down_proj.weight",), stack=1,
                      layer_type=mlp),
            ]
        E, S = L + "mlp.experts.{e}.", L + "mlp.shared_expert."
        entries += [
            Entry((A + "pre_mlp_layernorm.weight",), (L + "post_attention_layernorm.weight",),
                  stack=1, layer_type=mlp),
            Entry((A + "mlp.router.weight",), (L + "mlp.gate.weight",), stack=1, layer_type=mlp),
            Entry((A + "mlp.experts.experts.linear_fc1.weight",),
                  (E + "gate_proj.weight", E + "up_proj.weight"), "gate_up", 2, mlp),
            Entry((A + "mlp.experts.experts.linear_fc2.weight",), (E + "down_proj.weight",),
                  stack=2, layer_type=mlp),
        ]
        if spec.shared_expert_ffn_hidden_size:
            entries += [
                Entry((A + "mlp.shared_experts.linear_fc1.weight",),
                      (S + "gate_proj.weight", S + "up_proj.weight"), "gate_up", 1, mlp),
                Entry((A + "mlp.shared_experts.linear_fc2.weight",), (S + "down_proj.weight",),
                      stack=1, layer_type=mlp),
            ]
        if spec.shared_expert_gate:
            entries.append(Entry((A + "mlp.shared_experts.gate_weight",),
                                 (L + "mlp.shared_expert_gate.weight",), stack=1, layer_type=mlp))
        return entries

    def _mtp_entries(self) -> list[Entry]:
        """Qwen3.5's multi-token-prediction layer: megatron's MTP layer (enorm, hnorm, eh_proj,
        a full-attention transformer layer, final norm) ⇄ HF `mtp.*`. HF names the norms and
        the projection once, so only one MTP layer has an HF form."""
        if self.spec.mtp_num_layers != 1:
            raise WeightMapError(f"model '{self.spec.name}': HF checkpoints name one MTP layer; "
                                 f"mtp_num_layers={self.spec.mtp_num_layers}")
        M = "mtp.layers.{l}."
        return [
            Entry((M + "enorm.weight",), ("mtp.pre_fc_norm_embedding.weight",), stack=1,
                  layer_type="mtp"),
            Entry((M + "hnorm.weight",), ("mtp.pre_fc_norm_hidden.weight",), stack=1,
                  layer_type="mtp"),
            Entry((M + "eh_proj.weight",), ("mtp.fc.weight",), stack=1, layer_type="mtp"),
            Entry((M + "final_layernorm.weight",), ("mtp.norm.weight",), stack=1,
                  layer_type="mtp"),
            *self._layer_entries(M, M + "transformer_layer.", "mtp"),
        ]

    @staticmethod
    def _gated_deltanet_entries(L: str, A: str) -> list[Entry]:
        """Qwen3.5's linear-attention layers. megatron fuses q,k,v,z,b,a into one `in_proj`
        but checkpoints it per section (so TP can cut each section); HF keeps qkv fused.
        The output norm is a plain RMSNorm in both (HF initialises it to ones)."""
        G, S = A + "self_attention.", L + "linear_attn."

        def gdn(keys: tuple[str, ...], hf: str, kind: str = "copy") -> Entry:
            return Entry(tuple(G + k for k in keys), (S + hf,), kind, 1, "linear_attention")

        sections = tuple(f"in_proj.weight.{s}" for s in ("query", "key", "value"))
        return [
            Entry((G + "in_proj.layer_norm_weight",), (L + "input_layernorm.weight",),
                  stack=1, layer_type="linear_attention"),
            gdn(sections, "in_proj_qkv.weight", "split"),
            gdn(("in_proj.weight.z",), "in_proj_z.weight"),
            gdn(("in_proj.weight.beta",), "in_proj_b.weight"),
            gdn(("in_proj.weight.alpha",), "in_proj_a.weight"),
            gdn(tuple(f"conv1d.weight.{s}" for s in ("query", "key", "value")),
                "conv1d.weight", "split"),
            gdn(("A_log",), "A_log"),
            gdn(("dt_bias",), "dt_bias"),
            gdn(("out_norm.weight",), "norm.weight"),
            gdn(("out_proj.weight",), "out_proj.weight"),
        ]

    # -- enumeration ---------------------------------------------------------------------------
    def locate(self, key: str, leading: tuple[int, ...]) -> tuple[Entry, tuple[int, ...], int]:
        """(entry, logical index, position in entry.keys) of a checkpoint tensor, given the
        offsets of its stacked leading axes."""
        template, index = key, leading
        m = _LAYER_KEY.match(key)
        if m and (m[1] == "mtp" or not self.stacked_layers):  # one key per layer
            template, index = f"{m[1]}.layers.{{l}}.{m[3]}", (int(m[2]), *leading)
        try:
            entry, position = self._by_key[template]
        except KeyError:
            raise WeightMapError(f"megatron tensor '{key}' has no HF counterpart in the "
                                 f"'{self.spec.architecture}' weight map") from None
        return entry, index, position

    def checkpoint_keys(self, entry: Entry, index: tuple[int, ...]) -> list[str]:
        return [k.format(l=index[0]) if "{l}" in k else k for k in entry.keys]

    def has_layer_axis(self, entry: Entry) -> bool:
        """Whether the checkpoint tensor of `entry` is stacked over layers (axis 0)."""
        return self.stacked_layers and entry.stack > 0 and entry.layer_type != "mtp"

    def all_checkpoint_keys(self) -> set[str]:
        return {k for e, idx in self.units() for k in self.checkpoint_keys(e, idx)}

    def units(self) -> Iterator[tuple[Entry, tuple[int, ...]]]:
        """Every (entry, stacked index) in HF file order: embeddings, layer by layer, head."""
        flat = [e for e in self.entries if e.stack == 0]
        yield from ((e, ()) for e in flat if e.keys[0].startswith("embedding"))
        layers = [(i, kind) for i, kind in enumerate(self.spec.layer_types)]
        layers += [(i, "mtp") for i in range(self.spec.mtp_num_layers)]
        for layer, kind in layers:
            for e in self.entries:
                if e.stack == 0 or not _applies(e, kind):
                    continue
                if e.stack == 1:
                    yield e, (layer,)
                else:
                    for expert in range(self.spec.num_experts):
                        yield e, (layer, expert)
        yield from ((e, ()) for e in flat if not e.keys[0].startswith("embedding"))

    def hf_names(self) -> list[str]:
        return [n for e, idx in self.units() for n in e.hf_names(*idx)]

    def expert_groups(self) -> list[str]:
        """HF prefixes of the routed-expert groups, one per MoE layer (decoder layers, then
        MTP layers): `model.layers.3.mlp.experts`, `mtp.layers.0.mlp.experts`."""
        groups: dict[str, None] = {}
        for entry, index in self.units():
            if entry.stack == 2:
                groups.setdefault(entry.hf[0].split(".{e}.")[0].format(l=index[0]), None)
        return list(groups)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        s = self.spec
        h, d = s.hidden_size, s.head_dim
        q_rows = s.num_attention_heads * d * (2 if s.attention_output_gate else 1)
        per = {
            "embed_tokens.weight": (s.vocab_size, h), "lm_head.weight": (s.vocab_size, h),
            "model.norm.weight": (h,), "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "q_proj.weight": (q_rows, h),
            "k_proj.weight": (s.num_query_groups * d, h),
            "v_proj.weight": (s.num_query_groups * d, h),
            "o_proj.weight": (h, s.num_attention_heads * d),
            "q_norm.weight": (d,), "k_norm.weight": (d,),
            "mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,),
        }
        if s.is_moe:
            f = s.moe_ffn_hidden_size
            per.update({"mlp.gate.weight": (s.num_experts, h), "experts.*.gate_proj.weight":
                        (f, h), "experts.*.up_proj.weight": (f, h),
                        "experts.*.down_proj.weight": (h, f)})
            if s.shared_expert_ffn_hidden_size:
                f = s.shared_expert_ffn_hidden_size
                per.update({"shared_expert.gate_proj.weight": (f, h),
                            "shared_expert.up_proj.weight": (f, h),
                            "shared_expert.down_proj.weight": (h, f),
                            "shared_expert_gate.weight": (1, h)})
        else:
            f = s.ffn_hidden_size
            per.update({"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
                        "mlp.down_proj.weight": (h, f)})
        if (la := s.linear_attention) is not None:
            k, v = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
            n = la.num_value_heads
            per.update({"in_proj_qkv.weight": (2 * k + v, h), "in_proj_z.weight": (v, h),
                        "in_proj_b.weight": (n, h), "in_proj_a.weight": (n, h),
                        "conv1d.weight": (2 * k + v, 1, la.conv_kernel), "A_log": (n,),
                        "dt_bias": (n,), "linear_attn.norm.weight": (la.value_head_dim,),
                        "out_proj.weight": (h, v)})
        shapes = {}
        for name in self.hf_names():
            generic = re.sub(r"\.\d+\.", ".*.", name)
            shapes[name] = per[max((k for k in per if generic.endswith(k)), key=len)]
        return shapes

    def hf_shape(self, name: str) -> tuple[int, ...] | None:
        """`name`'s HF shape (None for a name this model does not have); `hf_shapes` once."""
        if not hasattr(self, "_hf_shapes"):
            self._hf_shapes = self.hf_shapes()
        return self._hf_shapes.get(name)

    def megatron_shapes(self, entry: Entry, index: tuple[int, ...]) -> list[torch.Size]:
        """Canonical shapes of `entry`'s Megatron tensors (one per key), computed on meta
        tensors: no weight is read."""
        return [t.shape for t in self.to_megatron(
            entry, index, lambda n: torch.empty(self.hf_shape(n), device="meta"))]

    # -- conversion ----------------------------------------------------------------------------
    def _split_sizes(self) -> list[int]:
        la = self.spec.linear_attention
        k = la.num_key_heads * la.key_head_dim
        return [k, k, la.num_value_heads * la.value_head_dim]

    def to_megatron(self, entry: Entry, index: tuple[int, ...],
                    get: HfGetter) -> list[torch.Tensor]:
        """The canonical (TP1) Megatron tensors of `entry` at `index` (one per key)."""
        parts = [get(n) for n in entry.hf_names(*index)]
        if entry.kind == "copy":
            return parts
        if entry.kind == "gate_up":
            return [torch.cat(parts, dim=0)]
        if entry.kind == "split":
            return list(parts[0].split(self._split_sizes(), dim=0))
        s = self.spec
        groups, d = s.num_query_groups, s.head_dim
        per_group = s.num_attention_heads // groups
        q, k, v = parts
        hidden = q.shape[-1]
        k, v = k.view(groups, d, hidden), v.view(groups, d, hidden)
        if entry.kind == "qkv":
            blocks = [q.view(groups, per_group * d, hidden), k, v]
        else:  # per head [q | gate] in HF; per group [q heads | gate heads | k | v] in megatron
            qg = q.view(groups, per_group, 2, d, hidden)
            blocks = [qg[:, :, 0].reshape(groups, per_group * d, hidden),
                      qg[:, :, 1].reshape(groups, per_group * d, hidden), k, v]
        return [torch.cat(blocks, dim=1).reshape(-1, hidden)]

    def to_hf(self, entry: Entry, index: tuple[int, ...], tensors: list[torch.Tensor],
              grouped: bool = False) -> dict[str, torch.Tensor]:
        """HF tensors of `entry` at `index` from its Megatron tensors (one per key).
        `grouped`: a split QKV's q, k and v may keep Megatron's query groups as a leading
        dimension ([groups, rows, hidden]: the HF tensor's elements in the same order), so
        they stay views of the input; with several groups the HF shape needs a copy."""
        names = entry.hf_names(*index)
        tensor = tensors[0]
        if entry.kind == "copy":
            return {names[0]: tensor}
        if entry.kind == "gate_up":
            gate, up = tensor.chunk(2, dim=0)
            return {names[0]: gate, names[1]: up}
        if entry.kind == "split":
            return {names[0]: torch.cat(tensors, dim=0)}
        s = self.spec
        groups, d = s.num_query_groups, s.head_dim
        per_group = s.num_attention_heads // groups
        hidden = tensor.shape[-1]
        gated = entry.kind == "gated_qkv"
        qkv = tensor.view(groups, ((2 if gated else 1) * per_group + 2) * d, hidden)
        if gated:
            q, gate, k, v = qkv.split([per_group * d, per_group * d, d, d], dim=1)
            q = torch.stack([q.reshape(groups, per_group, d, hidden),
                             gate.reshape(groups, per_group, d, hidden)], dim=2)
        else:
            q, k, v = qkv.split([per_group * d, d, d], dim=1)
            if grouped:
                return {names[0]: q, names[1]: k, names[2]: v}
        return {names[0]: q.reshape(-1, hidden), names[1]: k.reshape(-1, hidden),
                names[2]: v.reshape(-1, hidden)}


class HfLayout:
    """How an HF folder stores each routed-expert group (one MoE layer's experts):

      per_expert  `<group>.<e>.{gate,up,down}_proj.weight`: `save_pretrained`, the Qwen3-MoE
                  and FP8 releases, Qwen3.5's MTP experts
      fused       `<group>.gate_up_proj` [E, 2I, H] (per expert: gate rows, then up rows) and
                  `<group>.down_proj` [E, H, I]: transformers' in-memory experts, the Qwen3.5
                  bf16 release's decoder experts, Qwen3.6's MTP experts too

    The weight map speaks per-expert names; `source` says where such a name sits in a fused
    file (import reads just that slice) and `pack` fuses a layer's per-expert tensors back
    (export). Both are pure copies, so a round trip is bit-exact in either layout."""

    def __init__(self, wmap: WeightMap, groups: Mapping[str, str], where: str = "layout"):
        known = wmap.expert_groups()
        if not isinstance(groups, Mapping):
            raise WeightMapError(f"{where}: expert layout {groups!r} is not a table of "
                                 "group → layout")
        for group, layout in groups.items():
            if group not in known:
                raise WeightMapError(f"{where}: '{group}' is not a routed-expert group of "
                                     f"model '{wmap.spec.name}'")
            if layout not in EXPERT_LAYOUTS:
                raise WeightMapError(f"{where}: group {group} has layout {layout!r}; expected "
                                     f"one of {', '.join(EXPERT_LAYOUTS)}")
        absent = [g for g in known if g not in groups]
        if absent:
            raise WeightMapError(f"{where}: no expert layout for group {absent[0]}"
                                 + (f" (+{len(absent) - 1} more)" if len(absent) > 1 else ""))
        self.wmap = wmap
        self.groups = {g: groups[g] for g in known}

    @classmethod
    def uniform(cls, wmap: WeightMap, layout: str = PER_EXPERT) -> HfLayout:
        return cls(wmap, dict.fromkeys(wmap.expert_groups(), layout), "expert layout")

    @classmethod
    def from_json(cls, wmap: WeightMap, data: Any, where: str) -> HfLayout:
        """From a manifest's `hf_layout` (untrusted: every group and value is checked)."""
        if not isinstance(data, dict):
            raise WeightMapError(f"{where}: hf_layout {data!r} is not a JSON object")
        return cls(wmap, data, where)

    def to_json(self) -> dict[str, str]:
        return dict(self.groups)

    def __repr__(self) -> str:
        counts = {k: sum(v == k for v in self.groups.values()) for k in EXPERT_LAYOUTS}
        return f"HfLayout({', '.join(f'{k}={n}' for k, n in counts.items() if n)})"

    def _fused_names(self, group: str) -> dict[str, tuple[int, ...]]:
        s = self.wmap.spec
        e, i, h = s.num_experts, s.moe_ffn_hidden_size, s.hidden_size
        return {f"{group}.gate_up_proj": (e, 2 * i, h), f"{group}.down_proj": (e, h, i)}

    def source(self, name: str) -> tuple[str, tuple[int | slice, ...]] | None:
        """(fused file tensor, index into it) of a per-expert name whose group is fused;
        None when the file holds `name` itself."""
        m = _PER_EXPERT_NAME.fullmatch(name)
        if m is None or self.groups.get(m[1]) != FUSED:
            return None
        expert, i = int(m[2]), self.wmap.spec.moe_ffn_hidden_size
        if m[3] == "down_proj":
            return f"{m[1]}.down_proj", (expert,)
        rows = slice(0, i) if m[3] == "gate_proj" else slice(i, 2 * i)
        return f"{m[1]}.gate_up_proj", (expert, rows)

    def file_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor an HF file of this layout holds, in file order, with its shape."""
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in self.wmap.hf_shapes().items():
            m = _PER_EXPERT_NAME.fullmatch(name)
            if m is not None and self.groups.get(m[1]) == FUSED:
                for fused, fused_shape in self._fused_names(m[1]).items():
                    shapes.setdefault(fused, fused_shape)
            else:
                shapes[name] = shape
        return shapes

    def pack(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-expert HF tensors → the file's tensors: each fused group's experts stacked into
        its two fused tensors (every expert of the group must be in `tensors`), the rest as
        they are, in order."""
        plain: dict[str, torch.Tensor] = {}
        parts: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
        order: list[str] = []  # plain names and fused groups, as they first come
        for name, tensor in tensors.items():
            m = _PER_EXPERT_NAME.fullmatch(name)
            if m is None or self.groups.get(m[1]) != FUSED:
                plain[name] = tensor
                order.append(name)
            else:
                if m[1] not in parts:
                    parts[m[1]] = {}
                    order.append(m[1])
                parts[m[1]][(m[3], int(m[2]))] = tensor
        out: dict[str, torch.Tensor] = {}
        experts = range(self.wmap.spec.num_experts or 0)
        for name in order:
            if name in plain:
                out[name] = plain[name]
                continue
            got = parts[name]
            lacking = [f"{name}.{e}.{p}.weight" for e in experts
                       for p in ("gate_proj", "up_proj", "down_proj") if (p, e) not in got]
            if lacking:
                raise WeightMapError(f"cannot fuse {name}: {lacking[0]} was not produced")
            out[f"{name}.gate_up_proj"] = torch.stack(
                [torch.cat([got[("gate_proj", e)], got[("up_proj", e)]], dim=0)
                 for e in experts])
            out[f"{name}.down_proj"] = torch.stack([got[("down_proj", e)] for e in experts])
        return out
