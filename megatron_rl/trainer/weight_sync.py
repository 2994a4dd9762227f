"""Weight sync: the trainer's Megatron shards → full HF-named tensors → rollout engines.

Gather. Every trainer rank walks the weight map's units in the same order, one layer at a time
(the groups that need no gather first), each layer's units grouped by the ranks that hold
pieces of them as *main replica* (megatron's own sharding metadata says which layer, expert and
TP slice each local parameter is). The group's sender, the lowest rank holding a piece, fills a
flat buffer with its own pieces; each other holder sends its pieces to it, packed in one
message, and the sender puts them in place (where each goes was exchanged once): correct for
any TP/PP/EP/DP layout, and only a group's holders take part, each moving only what it holds.
So each pipeline stage sends its own layers (its first rank) and each expert-parallel rank its
own experts; a group that one rank holds whole (PP, EP without TP) is gathered from nowhere.
The sender converts the group to HF names with the same `WeightMap` the converters use.

Transfer. Each sender streams its HF tensors, in buckets, to every engine, over one of:
  tensor       `/update_weights_from_tensor` (the colocated path: a shared-memory segment for
               an engine on this machine, as SGLang passes CUDA IPC handles; values otherwise)
  distributed  a broadcast group between rank 0 and the engines (`/init_weights_update_group`
               + `/update_weights_from_distributed`; gloo on CPU, NCCL on GPU)
  disk         safetensors shards in a folder + `/update_weights_from_disk`
Every update carries a `weight_version`; engines stamp it on each token they generate after it.
With several senders rank 0 opens the update (the shared-memory pause), all senders write, and
after a barrier rank 0 alone moves the version (or loads the folder): no engine reports the new
version while a sender's layers are still old. `distributed` sends everything from rank 0 (its
broadcast group has one source).
On these three, where the gather crosses ranks, the next buckets (`look_ahead`, 3) are gathered
and converted in a worker thread while the current one is sent (`_Ahead`); what needs no
gather goes first, so even the first buckets' sends hide gathers (TP2: the vocabulary
matrices, 16-19 ms each here, had been the first and an unhidden lump).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import datetime
import functools
import math
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.checkpoint.weight_map import Entry, WeightMap
from megatron_rl.engines.http_client import HttpEngine
from megatron_rl.engines.shared_weights import SharedWeightWriter
from megatron_rl.engines.tensors import buckets_with_last, split_buckets
from megatron_rl.models.registry import ModelSpec
from megatron_rl.utils.parallel_copy import Pairs, copy_all, copy_shares

TRANSPORTS = ("tensor", "distributed", "disk")
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass
class SyncStats:
    """Where a sync's time went (one sender's view; rank 0's is the one reported)."""

    gather_s: float = 0.0     # filling layer buffers + the pieces other ranks send
    convert_s: float = 0.0    # Megatron → HF layout and dtype
    transfer_s: float = 0.0   # everything after conversion: serialise, send, engine load
    bytes: int = 0
    tensors: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    wall_s: float | None = None  # set when the phases overlap (the bucketed transports)

    @property
    def seconds(self) -> float:
        return (self.gather_s + self.convert_s + self.transfer_s if self.wall_s is None
                else self.wall_s)


def _sharded_tensors(module: torch.nn.Module) -> list:
    """The model's ShardedTensors, factories (fused fc1 halves, GDN sections) expanded; their
    `.data` are views of the live parameters."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for v in nested_values(module.sharded_state_dict()):
        if isinstance(v, ShardedTensorFactory):
            out += [t for t in nested_values(v.build()) if isinstance(t, ShardedTensor)]
        elif isinstance(v, ShardedTensor):
            out.append(v)
    return out


class WeightGatherer:
    """Collective iterator over the full HF-named weights of a (sharded) Megatron model."""

    def __init__(self, modules: Sequence[torch.nn.Module], spec: ModelSpec,
                 padded_vocab: int, group: Any = None, include_mtp: bool = False,
                 resolve: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """`include_mtp`: also the MTP block's weights; rollout engines decode without it
        (transformers has no MTP module; speculative rollout would need it). `resolve`: where
        a parameter's bytes are now (an offloaded actor's host copy, trainer/offload.py)."""
        self.resolve = resolve or (lambda t: t)
        self.spec, self.wmap, self.group = spec, WeightMap(spec), group
        self.padded_vocab = padded_vocab
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.modules, self.include_mtp = list(modules), include_mtp
        self.refresh()
        units = [(entry, index) for entry, index in self.wmap.units()
                 if include_mtp or entry.layer_type != "mtp"]
        # a layer's units by the ranks that hold them: at EP each rank's experts are a group
        # of their own, sent by that rank with nothing gathered
        groups: dict[Any, list[tuple[Entry, tuple[int, ...]]]] = {}
        for (entry, index), owners in zip(units, self._owners(units), strict=True):
            where = ("layer", entry.layer_type == "mtp", index[0]) if index else entry.keys
            groups.setdefault((where, owners), []).append((entry, index))
        self.layout = [self._group_layout(g) for g in groups.values()]
        # per group: its sender (the lowest rank holding a piece), whether nothing is to be
        # gathered (one holder; none: zeros) and its holders
        self.senders = [owners[0] if owners else 0 for _, owners in groups]
        self.sole = [len(owners) <= 1 for _, owners in groups]
        self.owners = [owners for _, owners in groups]
        # per rank, per group: where its pieces go in the group's buffer (a sender reads the
        # others' to place what they send), and per group whether the pieces cover it all
        mine = [[(offset, shape, offsets, sizes) for offset, shape, _, offsets, sizes
                 in self._pieces(slots)] for slots, _ in self.layout]
        self.placement = [mine]
        if self.world > 1:
            self.placement = [None] * self.world
            dist.all_gather_object(self.placement, mine, group=self.group)
        self.covered = [sum(math.prod(sizes) for rank in self.placement
                            for _, _, _, sizes in rank[g]) == total
                        for g, (_, total) in enumerate(self.layout)]
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if torch.cuda.is_available() else torch.device("cpu"))
        # the parameters' own dtype: pieces are copied, never summed, and a bf16 policy then
        # syncs bf16 bytes
        self.buffer_dtype = next((data.dtype for chunks in self.local.values()
                                  for data, _, _ in chunks), torch.float32)
        self.stats = SyncStats()

    def refresh(self) -> None:
        """(checkpoint key, logical index) → [(local data, offsets, sizes)] owned by this rank:
        views of the live parameters (an offload keeps their storages, so they stay valid)."""
        from megatron.core.dist_checkpointing.mapping import is_main_replica

        # per layer: its units' live views (see hf_tensors), by `one_sender`
        self.whole: dict[tuple[bool, bool], list] = {}
        self.local: dict[tuple[str, tuple[int, ...]], list[tuple[torch.Tensor, tuple, tuple]]] = {}
        for module in self.modules:
            for sh in _sharded_tensors(module):
                if not is_main_replica(sh.replica_id):
                    continue
                stack = sh.prepend_axis_num
                entry, index, position = self.wmap.locate(sh.key, tuple(sh.global_offset[:stack]))
                if entry.layer_type == "mtp" and not self.include_mtp:
                    continue
                key = self.wmap.checkpoint_keys(entry, index)[position]
                self.local.setdefault((key, index), []).append(
                    (sh.data, tuple(sh.global_offset[stack:]), tuple(sh.local_shape)))

    def _owners(self, units: list[tuple[Entry, tuple[int, ...]]]) -> list[tuple[int, ...]]:
        """Per unit: the ranks holding a piece of it as main replica. Every rank learns every
        rank's holdings once."""
        mine = [u for u, (entry, index) in enumerate(units)
                if any((key, index) in self.local
                       for key in self.wmap.checkpoint_keys(entry, index))]
        held = [mine]
        if self.world > 1:
            held = [None] * self.world
            dist.all_gather_object(held, mine, group=self.group)
        owners: list[list[int]] = [[] for _ in units]
        for rank, ours in enumerate(held):
            for u in ours:
                owners[u].append(rank)
        return [tuple(o) for o in owners]

    def _pieces(self, slots: list) -> Iterator[tuple[int, tuple, torch.Tensor, tuple, tuple]]:
        """This rank's pieces of one group in a fixed order: (the part's offset in the
        group's buffer, the part's shape, the live data, its offsets and sizes in the part)."""
        for _, index, parts in slots:
            for key, offset, shape in parts:
                for data, offsets, sizes in self.local.get((key, index), ()):
                    yield offset, tuple(shape), data, offsets, sizes

    def sends(self, one_sender: bool = False) -> bool:
        """Whether this rank yields tensors from `hf_tensors`."""
        return self.rank == 0 if one_sender else self.rank in self.senders

    def _group_layout(self, group: list[tuple[Entry, tuple[int, ...]]]) -> tuple[list, int]:
        """Where each tensor of one layer sits in its flat gather buffer (fixed per model, so
        computed once): [(entry, index, [(key, offset, shape)])], total elements."""
        slots, total = [], 0
        for entry, index in group:
            parts = []
            for key, shape in zip(self.wmap.checkpoint_keys(entry, index),
                                  self.wmap.megatron_shapes(entry, index), strict=True):
                shape = self._shape(key, shape)
                parts.append((key, total, shape))
                total += torch.Size(shape).numel()
            slots.append((entry, index, parts))
        return slots, total

    def _shape(self, key: str, shape: torch.Size) -> tuple[int, ...]:
        return (self.padded_vocab, *shape[1:]) if key in VOCAB_KEYS else tuple(shape)

    def _whole_units(self, slots: list, grouped: bool) -> list[list] | None:
        """One layer's units when this rank holds every one whole (one rank, nothing to
        reduce): each unit's HF (name, view) pairs, or its live Megatron tensors when its HF
        form must be computed anew. No copy. None otherwise."""
        units = []
        for entry, index, parts in slots:
            views = [_one_view(self.local.get((key, index), ()), tuple(shape), self.resolve)
                     for key, _, shape in parts]
            if any(v is None for v in views):
                return None
            # HF tensors that are views of the parameters are kept as they are; a unit whose
            # HF form is a copy (a reshape that cannot view) is converted on every sync
            pairs = list(self._converted(entry, index, parts, views, time.perf_counter(),
                                         grouped))
            inputs = {v.untyped_storage().data_ptr() for v in views}
            viewed = all(t.untyped_storage().data_ptr() in inputs for _, t in pairs)
            units.append(pairs if viewed else views)
        return units

    def _roles(self, one_sender: bool) -> tuple[list[int], list[bool]]:
        """Per group: its sender and whether nothing is reduced (`one_sender`: rank 0 sends
        all; what it holds alone stays unreduced, the rest comes to it)."""
        if not one_sender:
            return self.senders, self.sole
        return [0] * len(self.layout), [alone and sender == 0 for sender, alone
                                        in zip(self.senders, self.sole, strict=True)]

    def crosses_ranks(self, one_sender: bool = False) -> bool:
        """Whether `hf_tensors` moves pieces between ranks: what a look-ahead overlaps with
        the sends. Without that it yields views of the live parameters and converts a few of
        them (a fused QKV's split): nothing worth producing ahead."""
        return not all(self._roles(one_sender)[1])

    def hf_tensors(self, dtype: torch.dtype | None = None, one_sender: bool = False,
                   grouped: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Every rank must exhaust this iterator (it moves the pieces); each layer's sender
        yields its (HF name, full tensor) pairs (`one_sender`: rank 0 yields them all). A
        layer its sender holds whole comes as views of the live parameters (nothing is copied
        before the consumer's own copy): copy what you keep. `grouped`: a split QKV may come
        as [groups, rows, hidden] views (`WeightMap.to_hf`), not copied into HF's shape."""
        self.stats = SyncStats()
        senders, sole = self._roles(one_sender)
        # an offloaded actor's parameters are read from their host copies, which move; live
        # ones keep their storages (an optimizer step writes them in place), so the views
        # found once serve every later sync
        live = all(self.resolve(data) is data for chunks in self.local.values()
                   for data, _, _ in chunks)
        plan = self.whole.get((one_sender, grouped)) if live else None
        if plan is None:
            plan = [self._whole_units(slots, grouped) if alone and sender == self.rank else None
                    for (slots, _), sender, alone in zip(self.layout, senders, sole,
                                                         strict=True)]
            if live:
                self.whole[one_sender, grouped] = plan
        self.stats.extra["gathered_layers"] = 0
        # what needs no gather first: a look-ahead then gathers the rest (the TP-split
        # vocabulary matrices, the largest) while those are sent. Every rank, one order
        for g in sorted(range(len(self.layout)), key=lambda g: not sole[g]):
            (slots, total), units, sender, alone = self.layout[g], plan[g], senders[g], sole[g]
            if alone and sender != self.rank:  # another rank's layer, nothing to gather
                continue
            if units is not None:  # nothing to gather
                t1 = time.perf_counter()
                for (entry, index, parts), unit in zip(slots, units, strict=True):
                    pairs = (unit if unit and isinstance(unit[0], tuple)
                             else self._converted(entry, index, parts, unit, t1, grouped))
                    for name, t in pairs:
                        yield name, self._counted(t, dtype)
                    t1 = time.perf_counter()
                continue
            t0 = time.perf_counter()
            if self.rank != sender:  # a holder's pieces, packed, to the sender
                if self.placement[self.rank][g]:
                    self._send_pieces(slots, sender)
                    self.stats.extra["gathered_layers"] += 1
                self.stats.gather_s += time.perf_counter() - t0
                continue
            flat = (torch.empty if self.covered[g] else torch.zeros)(
                total, dtype=self.buffer_dtype, device=self.device)
            for offset, shape, data, offsets, sizes in self._pieces(slots):
                # an offloaded actor's parameter: the same view of its host copy
                _region(flat, offset, shape, offsets, sizes).copy_(self.resolve(data).detach())
            if not alone:
                for rank in self.owners[g]:
                    if rank != sender:
                        self._receive_pieces(flat, rank, g)
                self.stats.extra["gathered_layers"] += 1
            t1 = time.perf_counter()
            self.stats.gather_s += t1 - t0
            for entry, index, parts in slots:
                tensors = [flat[offset:offset + torch.Size(shape).numel()].view(shape)
                           for _, offset, shape in parts]
                for name, t in self._converted(entry, index, parts, tensors, t1, grouped):
                    yield name, self._counted(t, dtype)
                t1 = time.perf_counter()

    def _packed(self, sizes: list[tuple]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One message for pieces of these sizes, and each piece's view of it, in order."""
        numels = [math.prod(size) for size in sizes]
        packed = torch.empty(sum(numels), dtype=self.buffer_dtype, device=self.device)
        return packed, [v.view(size) for v, size in zip(packed.split(numels), sizes,
                                                          strict=True)]

    def _send_pieces(self, slots: list, sender: int) -> None:
        pieces = list(self._pieces(slots))
        packed, views = self._packed([sizes for *_, sizes in pieces])
        for view, (_, _, data, _, _) in zip(views, pieces, strict=True):
            view.copy_(self.resolve(data).detach())
        dist.send(packed, group_dst=sender, group=self.group)

    def _receive_pieces(self, flat: torch.Tensor, rank: int, g: int) -> None:
        pieces = self.placement[rank][g]
        packed, views = self._packed([sizes for *_, sizes in pieces])
        dist.recv(packed, group_src=rank, group=self.group)
        for view, (offset, shape, offsets, sizes) in zip(views, pieces, strict=True):
            _region(flat, offset, shape, offsets, sizes).copy_(view)

    def _converted(self, entry: Entry, index: tuple[int, ...], parts: list,
                   tensors: list[torch.Tensor], t1: float, grouped: bool = False
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """One unit's Megatron tensors → HF (name, tensor) pairs, timing the conversion (the
        time the consumer spends between two pairs is not ours)."""
        tensors = [t[: self.spec.vocab_size] if key in VOCAB_KEYS else t
                   for (key, _, _), t in zip(parts, tensors, strict=True)]
        for name, t in self.wmap.to_hf(entry, index, tensors, grouped).items():
            self.stats.convert_s += time.perf_counter() - t1
            yield name, t
            t1 = time.perf_counter()

    def hf_shaped(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t`, `name`'s tensor from `hf_tensors(grouped=True)`, in its HF shape."""
        shape = self.wmap.hf_shape(name)
        return t.reshape(shape) if shape is not None and len(shape) != t.dim() else t

    def _counted(self, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        t = t.to(dtype) if dtype is not None else t
        self.stats.tensors += 1
        self.stats.bytes += t.numel() * t.element_size()
        return t


def _region(flat: torch.Tensor, offset: int, shape: tuple, offsets: tuple, sizes: tuple
            ) -> torch.Tensor:
    """A piece's place in a group's flat buffer: its part at `offset`, viewed as `shape`, then
    the piece's `offsets` and `sizes` in it."""
    full = flat[offset:offset + math.prod(shape)].view(shape)
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]


def _viewed_as(dst: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor | None:
    """`dst` (an engine's HF-shaped parameter) in `t`'s shape when t is its value: the same
    shape, or grouped ([groups, rows, cols] for [groups * rows, cols], `WeightMap.to_hf`)."""
    if dst is None or dst.shape == t.shape:
        return dst
    if t.dim() == dst.dim() + 1 and (t.shape[0] * t.shape[1], *t.shape[2:]) == dst.shape:
        return dst.view(t.shape)
    return None


def _one_view(chunks: Sequence[tuple[torch.Tensor, tuple, tuple]], shape: tuple[int, ...],
              resolve: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """The chunks of one tensor as one view when they tile `shape` along dim 0 back to back in
    memory (a parameter megatron describes in pieces, e.g. the fused fc1's gate and up
    halves); None when they do not (another rank owns some, or they live apart)."""
    if not chunks:
        return None
    chunks = sorted(((resolve(d).detach(), o, n) for d, o, n in chunks), key=lambda c: c[1])
    first, rows, elems = chunks[0][0], 0, 0
    for data, offsets, sizes in chunks:
        if (not data.is_contiguous() or offsets[0] != rows or any(offsets[1:])
                or tuple(sizes[1:]) != shape[1:] or data.dtype != first.dtype
                or data.data_ptr() != first.data_ptr() + elems * first.element_size()):
            return None
        rows, elems = rows + sizes[0], elems + data.numel()
    if rows != shape[0]:
        return None
    return first.as_strided(shape, torch.empty(shape, device="meta").stride(),
                            first.storage_offset())


def gatherer_for(actor: Any) -> WeightGatherer:
    from megatron_rl.models.builder import padded_vocab_size

    return WeightGatherer([m.module for m in actor.model], actor.spec,
                          padded_vocab_size(actor.spec, actor.cfg.parallel),
                          resolve=getattr(actor, "readable", None))


class WeightSyncer:
    """Pushes the trainer's weights to rollout engines, every trainer rank calling `sync`
    together. Keeps its engine clients between syncs (their HTTP sessions and, for the shm
    tensor path, the shared-memory segment, whose pages stay warm)."""

    def __init__(self, gatherer: WeightGatherer, urls: Sequence[str], *,
                 transport: str = "tensor", bucket_bytes: int = 512 << 20,
                 dtype: torch.dtype | None = None, disk_dir: str | None = None,
                 master_address: str = "127.0.0.1", timeout_s: float = 600.0,
                 fp8: bool = False, one_copy: bool = True, look_ahead: int = 3,
                 by_owner: bool = True):
        """`fp8`: send the projections as blockwise FP8 + `weight_scale_inv` (an engine that
        serves an FP8 checkpoint, docs/fp8.md); each weight and its scale share a bucket.
        `one_copy`: with the tensor transport, write straight into the parameters of engines
        that share them on this machine (engines/shared_weights.py). `look_ahead`: buckets
        gathered and converted ahead of the one being sent, where the gather crosses ranks (0: each
        only after the previous one was sent, benchmarks/weight_sync.py's reference; they
        hold memory of their own where they were reduced). `by_owner=False`: every layer is
        reduced onto rank 0, which sends them all (the benchmark's reference for a sender per
        owner)."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}: choose one of {', '.join(TRANSPORTS)}")
        if not urls:
            raise ValueError("urls: at least one engine URL is needed")
        self.gatherer, self.transport, self.bucket_bytes = gatherer, transport, bucket_bytes
        self.dtype, self.disk_dir, self.fp8 = dtype, disk_dir, fp8
        self.master_address, self.timeout_s = master_address, timeout_s
        self.one_copy, self.look_ahead = one_copy, look_ahead
        self._writers: list[SharedWeightWriter] | None = None
        self._plan: tuple | None = None  # the last one-copy write's (key, shares, tensors)
        self._shared: bool | None = None  # every sender writes the engines' memory
        self.engines: list[HttpEngine] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        # the distributed transport's broadcast group has one source
        self.one_sender = transport == "distributed" or not by_owner
        self.several = not self.one_sender and len(set(gatherer.senders)) > 1
        if self.several and transport == "disk" and disk_dir is None:
            self.disk_dir = _from_rank0(gatherer, tempfile.mkdtemp(prefix="weights-")
                                        if gatherer.rank == 0 else None)
        if gatherer.sends(self.one_sender) or (self.several and gatherer.rank == 0):
            self.loop = asyncio.new_event_loop()
            self.engines = [HttpEngine(u, bucket_bytes=bucket_bytes, timeout_s=timeout_s,
                                       tensor_transport="shm" if _same_machine(u)
                                       else "safetensors") for u in urls]

    def shares_parameters(self) -> bool:
        """Collective: whether every sender writes straight into the engines' parameters
        (each maps their shared memory; asked once). Then the engines' owner may hold them
        for the writes itself (`sync(held=...)`)."""
        if self._shared is None:
            g = self.gatherer
            sender = g.sends() if self.several else g.sends(self.one_sender)
            mine = not sender or (self.transport == "tensor" and bool(self._shared_writers()))
            self._shared = _all_ranks(g, mine)
        return self._shared

    def sync(self, weight_version: int, held: list[str] | None = None) -> SyncStats:
        """Collective: push the current weights with `weight_version`. Returns this rank's
        time split (rank 0's is the one reported; a rank that sends nothing: its gather).
        `held`: the engines are already held for a write into their parameters, by their
        owner (`EmbeddedCore.weights_held`: these are their segments' labels), who commits
        the version once every rank returned; the ranks then only write (no begin, commit
        or rendezvous of their own)."""
        t_start = time.perf_counter()
        if held is not None and not self.shares_parameters():
            raise ValueError("sync(held=...): the engines' parameters are not written in "
                             "place (transport, fp8 or another machine): nothing to hold")
        if self.several:
            return self._sync_by_owner(weight_version, t_start, held)
        if not self.gatherer.sends(self.one_sender):
            for _ in self.gatherer.hf_tensors(self.dtype, self.one_sender):
                pass  # take part in the reductions
            return self.gatherer.stats
        sent = [0]
        quantize = _counted(sent, self.fp8)
        writers = self._shared_writers() if self.transport == "tensor" else None
        # written into the engines' parameters: a split QKV as views, viewed there alike
        tensors = self.gatherer.hf_tensors(self.dtype, self.one_sender, grouped=bool(writers))
        ahead = self._ahead()
        if writers:
            self.loop.run_until_complete(self._write_shared(
                writers, tensors, None if held else weight_version, held))
        elif self.transport == "tensor":
            self.loop.run_until_complete(_push_tensors(
                self.engines, ahead(buckets_with_last(tensors, self.bucket_bytes)),
                weight_version, quantize))
        elif self.transport == "disk":
            # streamed: the bucket being written and the one being gathered are in memory
            self.loop.run_until_complete(_push_disk(
                self.engines, ahead(split_buckets(tensors, self.bucket_bytes)), weight_version,
                self.disk_dir, quantize))
        else:
            self.loop.run_until_complete(_push_distributed(
                self.engines, ahead(buckets_with_last(tensors, self.bucket_bytes)),
                weight_version, self.master_address, self.timeout_s, quantize))
        return self._timed(t_start, sent[0], ahead if not writers else None)

    def _ahead(self) -> _Ahead:
        """The look-ahead where the gather crosses ranks (TP, or one sender): with nothing to
        move (one rank; PP or EP alone) the next bucket is made when it is wanted."""
        crosses = getattr(self.gatherer, "crosses_ranks", None)
        # where the gather's collectives run (a gatherer without one: the host)
        return _Ahead(getattr(self.gatherer, "device", torch.device("cpu")),
                      self.look_ahead if crosses is None or crosses(self.one_sender) else 0)

    def _timed(self, t_start: float, sent: int, ahead: _Ahead | None) -> SyncStats:
        stats = self.gatherer.stats
        stats.extra["sent_bytes"] = sent
        wall = time.perf_counter() - t_start
        if ahead is None:
            stats.transfer_s = wall - stats.gather_s - stats.convert_s
        else:  # gather and convert ran beside the sends: the phases add up to more than wall
            stats.transfer_s, stats.wall_s = ahead.caller_s, wall
        return stats

    def _sync_by_owner(self, version: int, t_start: float, held: list[str] | None
                       ) -> SyncStats:
        """Several senders (each pipeline stage, each expert-parallel rank): rank 0 opens the
        update, every sender writes what it holds, and after a barrier rank 0 alone moves the
        version (`held`: the engines' owner opened it and closes it)."""
        g, loop = self.gatherer, self.loop
        sender = g.sends()
        writers = self._shared_writers() if sender and self.transport == "tensor" else None
        shared = self.shares_parameters()  # agreed once: a writer is mapped for good or raises
        tensors = g.hf_tensors(self.dtype, self.one_sender, grouped=shared)
        segments = held
        if held is None and shared:  # the engines are paused before anyone writes
            if g.rank == 0:
                segments = loop.run_until_complete(
                    _on_all(self.engines, lambda e: e.begin_shared_write()))
            segments = self._segments_from_rank0(segments, writers)
        elif held is None:
            dist.barrier(group=g.group)
        sent, ahead = [0], None
        if not sender:
            for _ in tensors:  # take part in the reductions
                pass
        elif shared:
            loop.run_until_complete(self._write_shared(writers, tensors, None, segments))
        elif self.transport == "tensor":
            ahead = self._ahead()
            loop.run_until_complete(_push_tensors(
                self.engines, ahead(buckets_with_last(tensors, self.bucket_bytes)), None,
                _counted(sent, self.fp8)))
        else:
            ahead = self._ahead()
            loop.run_until_complete(_push_disk(
                self.engines, ahead(split_buckets(tensors, self.bucket_bytes)), version,
                self.disk_dir, _counted(sent, self.fp8), part=f"rank{g.rank:05d}-"))
        if held is not None:  # the owner commits once every rank has returned
            return self._timed(t_start, sent[0], ahead)
        dist.barrier(group=g.group)  # every sender's tensors are in
        if g.rank == 0:
            if shared:
                loop.run_until_complete(
                    _on_all(self.engines, lambda e: e.commit_shared_write(version)))
            elif self.transport == "tensor":  # no tensors: the version alone moves
                loop.run_until_complete(_on_all(
                    self.engines, lambda e: e.update_weights_from_tensors([], version)))
            else:
                loop.run_until_complete(_load_disk(self.engines, self.disk_dir, version))
        return self._timed(t_start, sent[0], ahead)

    def _segments_from_rank0(self, segments: list[str] | None,
                             writers: list[SharedWeightWriter] | None) -> list[str] | None:
        """The engines' segments rank 0's begin returned, on every rank: one int when they are
        the ones mapped (every rank maps the same, at the same syncs), else the names."""
        g = self.gatherer
        mapped = [w.name for w in writers or ()]
        same = torch.tensor([int(g.rank == 0 and segments == mapped)])
        dist.broadcast(same, group_src=0, group=g.group)
        return mapped if same.item() else _from_rank0(g, segments)

    def _shared_writers(self) -> list[SharedWeightWriter] | None:
        """One writer per engine when every engine shares its parameters with this machine
        (the embedded engine on loopback), else None: the bucketed path. Asked once."""
        if self._writers is None:
            usable = (self.one_copy and not self.fp8
                      and all(_same_machine(e.url) for e in self.engines))
            self._writers = (self.loop.run_until_complete(self._map_segments()) or []
                             if usable else [])
        return self._writers or None

    async def _map_segments(self) -> list[SharedWeightWriter] | None:
        layouts = await asyncio.gather(*(e.shared_weights() for e in self.engines))
        if any(layout is None for layout in layouts):
            return None
        self._close_writers()
        try:
            return [SharedWeightWriter(layout) for layout in layouts]
        except FileNotFoundError:  # loopback into another PID namespace or container
            return None

    def _close_writers(self) -> None:
        self._plan = None  # it holds views of the segments
        for w in self._writers or ():
            w.close()
        self._writers = []

    async def _write_shared(self, writers: list[SharedWeightWriter], tensors: Iterator,
                            version: int | None, segments: list[str] | None = None) -> None:
        """Pause → write every tensor into each engine's own parameters → commit the
        version. Names an engine does not share (scattered elements) go by its tensor route
        inside the same window. `segments`: the window is already open (rank 0 opened it);
        `version` None: another rank commits it."""
        begun = None
        if segments is None:  # the engines hold their steps while the tensors are walked
            begun = asyncio.ensure_future(
                asyncio.gather(*(e.begin_shared_write() for e in self.engines)))
            await asyncio.sleep(0)  # the requests leave before the walk holds the loop
        t0 = time.perf_counter()
        named = list(tensors)
        shares, rest = self._targets(writers, named)
        t_walked = time.perf_counter()
        if begun is not None:
            segments = await begun
        if any(s != w.name for s, w in zip(segments, writers, strict=True)):
            writers = self._writers = await self._map_segments()  # an engine restarted
            if not writers:
                raise RuntimeError("an engine stopped sharing its weights mid-run")
            shares, rest = self._targets(writers, named)
        t1 = time.perf_counter()
        copy_all(shares)
        write_s = time.perf_counter() - t1
        await asyncio.gather(*(e.update_weights_from_tensors(left, None)
                               for e, left in zip(self.engines, rest, strict=True) if left))
        t2 = time.perf_counter()
        if version is not None:
            await asyncio.gather(*(e.commit_shared_write(version) for e in self.engines))
        self.gatherer.stats.extra.update(
            walk_s=t_walked - t0, begin_wait_s=t1 - t_walked,
            write_s=write_s, flip_s=time.perf_counter() - t2,
            unshared=sum(len(left) for left in rest))

    def _targets(self, writers: list[SharedWeightWriter], named: list[tuple[str, torch.Tensor]]
                 ) -> tuple[list[Pairs], list[Bucket]]:
        """(engine parameter, tensor) pairs to copy, split over the copying threads, and per
        engine the (name, tensor) pairs it does not share, in their HF shapes. The same
        tensor objects as last time (the gatherer's views of live parameters) into the same
        writers: last time's plan (it holds them, so their ids are not reused)."""
        key = ([id(w) for w in writers], [(name, id(t)) for name, t in named])
        if self._plan is not None and self._plan[0] == key:
            return self._plan[1], [[] for _ in writers]
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        rest: list[Bucket] = [[] for _ in writers]
        for name, t in named:
            for w, left in zip(writers, rest, strict=True):
                dst = _viewed_as(w.target(name), t)
                if dst is not None:
                    copies.append((dst, t))
                else:  # t may be a view of a live parameter: the bucket keeps a copy
                    left.append((name, self.gatherer.hf_shaped(name, t).clone()))
        shares = copy_shares(copies, torch.get_num_threads())
        # kept only where every tensor is written in place (the rest are copies of values)
        self._plan = (key, shares, named) if not any(rest) else None
        return shares, rest

    def close(self) -> None:
        self._close_writers()
        if self.loop is not None:
            self.loop.run_until_complete(_close_all(self.engines))
            self.loop.close()
            self.loop = None

    def __enter__(self) -> WeightSyncer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _on_all(engines: list[HttpEngine], call: Callable[[HttpEngine], Any]) -> list:
    return list(await asyncio.gather(*(call(e) for e in engines)))


async def _close_all(engines: list[HttpEngine]) -> None:
    await asyncio.gather(*(e.close() for e in engines))


def _same_machine(url: str) -> bool:
    """A loopback engine shares this machine's memory: the tensor path can hand it a
    shared-memory segment instead of sending the bytes over HTTP."""
    from urllib.parse import urlparse

    return urlparse(url).hostname in ("127.0.0.1", "localhost", "::1")


Bucket = list[tuple[str, torch.Tensor]]


def _counted(sent: list[int], fp8: bool = False) -> Callable[[Bucket], Bucket]:
    """What a bucket goes out as (`fp8`: its projections blockwise e4m3 + scale_inv), with
    its bytes added to `sent[0]`."""
    from megatron_rl.checkpoint.fp8 import quantize_named

    def send(bucket: Bucket) -> Bucket:
        out = list(quantize_named(bucket)) if fp8 else bucket
        sent[0] += sum(t.numel() * t.element_size() for _, t in out)
        return out
    return send


_END = object()


@functools.cache
def _gather_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-gather")


class _Ahead:
    """Iterates items `look_ahead` ahead: while the caller sends item k, a worker thread
    produces items k+1 .. k+look_ahead (the gather's reductions and the HF conversion of the
    next buckets). Reductions come in lumps (a vocabulary matrix, then layers whose experts
    need none), so one item ahead leaves the sends waiting. One `next` at a time (one worker
    thread), so the producer's order and its collectives are unchanged. `caller_s`: the time
    the caller held items (sending them). `look_ahead=0`: item k+1 is produced only after
    the caller is done with item k."""

    def __init__(self, device: torch.device, look_ahead: int = 1):
        self.device, self.look_ahead, self.caller_s = device, look_ahead, 0.0

    def _pull(self, items: Iterator) -> Any:
        if self.device.type == "cuda":  # the gather's collectives run on the trainer's GPU
            torch.cuda.set_device(self.device)
        return next(items, _END)

    async def __call__(self, items: Iterator) -> AsyncIterator:
        loop = asyncio.get_running_loop()

        def pull() -> asyncio.Future:  # queued behind the earlier pulls on the one thread
            return loop.run_in_executor(_gather_thread(), self._pull, items)

        pending = collections.deque(pull() for _ in range(max(1, self.look_ahead)))
        try:
            while (item := await pending.popleft()) is not _END:
                if self.look_ahead:
                    pending.append(pull())
                t0 = time.perf_counter()
                yield item
                self.caller_s += time.perf_counter() - t0
                if not self.look_ahead:
                    pending.append(pull())
        finally:  # the caller stopped early: let the thread's pulls finish first
            await asyncio.gather(*pending, return_exceptions=True)


async def _push_tensors(engines: list[HttpEngine], buckets: AsyncIterator, version: int,
                        transform: Callable[[Bucket], Bucket]) -> None:
    async with contextlib.aclosing(buckets):
        async for bucket, last in buckets:
            bucket = transform(bucket)
            await asyncio.gather(*(e.update_weights_from_tensors(
                bucket, version if last else None) for e in engines))


async def _push_disk(engines: list[HttpEngine], buckets: AsyncIterator, version: int,
                     disk_dir: str | None, transform: Callable[[Bucket], Bucket],
                     part: str | None = None) -> None:
    """Safetensors shards into `<disk_dir>/v<version>`, then the engines load the folder.
    `part`: one of several senders' file-name prefix; no index, and the load is left to rank
    0 (`_load_disk`) once every part is written."""
    from megatron_rl.checkpoint.hf_io import ShardedSafetensorsWriter

    root = Path(disk_dir or tempfile.mkdtemp(prefix="weights-"))
    folder = root / f"v{version}"
    folder.mkdir(parents=True, exist_ok=True)
    writer = ShardedSafetensorsWriter(folder, prefix=part)
    async with contextlib.aclosing(buckets):
        async for bucket in buckets:
            for name, t in transform(bucket):
                writer.add(name, t)
    writer.close()
    if part is None:
        await _load_disk(engines, str(root), version)


async def _load_disk(engines: list[HttpEngine], root: str, version: int) -> None:
    folder = str(Path(root) / f"v{version}")
    await asyncio.gather(*(e.update_weights_from_disk(folder, version) for e in engines))


def _from_rank0(gatherer: WeightGatherer, obj: Any) -> Any:
    """Rank 0's `obj` on every rank of the gatherer's group."""
    box = [obj]
    dist.broadcast_object_list(box, group_src=0, group=gatherer.group)
    return box[0]


def _all_ranks(gatherer: WeightGatherer, ok: bool) -> bool:
    if not dist.is_initialized():  # one process, no group (a gatherer of plain tensors)
        return ok
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=gatherer.group)
    return bool(flag.item())


async def _push_distributed(engines: list[HttpEngine], buckets: AsyncIterator, version: int,
                            master_address: str, timeout_s: float,
                            transform: Callable[[Bucket], Bucket]) -> None:
    """Rank 0 and the engines form their own broadcast group (rank 0 = trainer, engine i =
    rank i + 1); each bucket is announced over HTTP while rank 0 broadcasts it."""
    from megatron_rl.distributed.process_groups import free_port

    loop = asyncio.get_running_loop()
    world, port = 1 + len(engines), free_port()
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    store = dist.TCPStore(master_address, port, world, is_master=True, timeout=timeout,
                          wait_for_workers=False)  # the engines join after our POST
    joins = [asyncio.create_task(e.init_weights_update_group(
        master_address, port, i + 1, world, backend=backend)) for i, e in enumerate(engines)]
    pg = await loop.run_in_executor(None, lambda: _broadcast_group(store, world, timeout))
    await asyncio.gather(*joins)
    try:
        async with contextlib.aclosing(buckets):
            async for bucket, last in buckets:
                bucket = transform(bucket)
                announce = [asyncio.create_task(e.update_weights_from_distributed(
                    [n for n, _ in bucket], [t.dtype for _, t in bucket],
                    [list(t.shape) for _, t in bucket], version if last else None,
                    flush_cache=last)) for e in engines]

                def send(bucket=bucket) -> None:
                    for _, t in bucket:
                        pg.broadcast(t.contiguous(), 0).wait()

                await loop.run_in_executor(None, send)
                await asyncio.gather(*announce)
    finally:
        await asyncio.gather(*(e.destroy_weights_update_group() for e in engines),
                             return_exceptions=True)


def _broadcast_group(store: Any, world: int, timeout: datetime.timedelta) -> Any:
    """Rank 0 of a group outside the trainer's world (engines are not torch ranks of it)."""
    if torch.cuda.is_available():
        return dist.ProcessGroupNCCL(store, 0, world)
    return dist.ProcessGroupGloo(store, 0, world, timeout)
