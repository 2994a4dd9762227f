"""Token-budget micro-batches and sequence packing (the actor's dynamic batch size).

With `train.max_tokens_per_microbatch = 0` the actor keeps its fixed path: each DP rank takes an
equal contiguous slice of rows and splits it into `micro_batch_size`-row micro-batches padded
to the batch's full width. With a budget B the rows are planned here instead:

1. **Effective length** of a row = last trained target + 1 (`loss_mask`); tokens after it cannot
   change any trained token's log-prob (causal model), so they are dropped. Rows with no trained
   target are skipped altogether (they add nothing to a loss sum or count).
2. **DP split, balanced by tokens** (LPT): rows sorted by length, longest first, each to the DP
   rank holding the fewest tokens so far (ties: fewer rows, then lower rank). Every rank plans
   the whole batch (it is the same on every rank), so no communication is needed.
3. **Micro-batches per rank, first-fit decreasing**: the rank's rows, longest first; a
   micro-batch is opened with the width W of its longest row (rounded up to `multiple`: TP under
   sequence parallelism, 2*CP with context parallelism) and holds at most max(1, B // W) rows,
   so rows x width <= B. Without packing each row is one sequence; the following (shorter)
   sequences fill it in order, the rest go to the next micro-batch. With packing each row is a
   bin of W tokens: a sequence goes to the first row with room, else to a new row while the
   micro-batch has fewer than B // W rows, else to a later micro-batch. Keeping W = the longest
   sequence (not B) keeps the local attention's dense [W, W] scores per row as cheap as without
   packing. A single sequence longer than B gets a micro-batch of its own (logged once).
4. **Equal micro-batch counts**: megatron's schedule and the gradient all-reduce need the same
   number on every DP rank; a rank with fewer gets empty ones (one fully masked row of
   `multiple` tokens). The allgather MoE dispatcher with EP > 1 needs equal token counts
   across the EP group: then all ranks plan in lockstep (`plan_lockstep`), micro-batch i
   taking one [rows, width] on every rank, still within the budget.

Rows are never split, so every loss sees whole sequences and each (sum, count) aggregation mode
gives the same global mean as the fixed path. A packed micro-batch carries a `loss_view`: its
sequences as ordinary trimmed rows, onto which the model's per-token output is unpacked before
the loss runs, so losses with per-row aggregates (seq-mean, GSPO) need no packing awareness.

Packing puts several sequences in one row: position ids restart per sequence (RoPE follows them
through `RowPositionRoPE`), attention is block-diagonal causal via an explicit mask (the local
`DotProductAttention` applies a given mask as is), and every per-token extra is packed the same
way. It is refused, with the reason logged once, where the layers cannot honour that
(`packing_unsupported`).

**Shared prefixes** (`train.share_prefixes`, with packing): an agent's turns begin with their
role's system prompt and a group's samples with the same prompt, so most of a batch's tokens
are copies. After the DP split, a rank's rows are sorted by their untrained opening and those
that begin alike go into one `PrefixGroup`: the common opening (its *trunk*, never past any
member's first trained target) is packed once, each member's remainder after it as a branch
that attends to the trunk and causally to itself, with positions that continue the trunk's.
The planner sees a group as one sequence of its packed size (at most the budget). Each
branch's tokens are computed as in its own row, the trunk's once: forward and backward run
fewer tokens for the same log-probs and gradients. Only the MoE load-balancing loss, which
counts tokens, counts the trunk once.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl.records.batch import NOT_ROUTED, ROUTED_EXPERTS, TokenBatch

log = logging.getLogger(__name__)
_LOGGED: set[str] = set()

# what an extra holds at a padding position when it is not 0 (routing replay: no engine
# routing, the model routes the token itself)
PAD_VALUES: dict[str, float] = {ROUTED_EXPERTS: NOT_ROUTED}


def log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.warning(message)


@dataclass
class MicroBatch(TokenBatch):
    """What the model sees for one micro-batch ([B, S]: trimmed or packed rows) plus where its
    sequences came from. Extras are laid out like `input_ids` (packed when packed)."""

    sources: torch.Tensor | None = None   # [n] original batch row of each sequence
    lengths: torch.Tensor | None = None   # [n] effective length of each sequence
    valid: torch.Tensor | None = None     # [B, S] bool: a real token (not padding)
    segments: torch.Tensor | None = None  # [B, S] sequence slot in its packed row, -1 = pad
    trunks: torch.Tensor | None = None    # [B, S] slot of the shared prefix it extends, -1 = none
    unpack_index: torch.Tensor | None = None  # [n, L] flat index into [B * S]; packed only
    loss_view: TokenBatch | None = None   # packed: the n sequences as rows [n, L]

    @property
    def empty(self) -> bool:
        return self.sources is None or self.sources.numel() == 0

    @property
    def packed(self) -> bool:
        return self.segments is not None

    def attention_mask(self) -> torch.Tensor:
        """The model call's mask, its rows' sequences as `packed_spans`: the attention
        (`layer_specs.torch_sdpa_attention`) attends within each sequence (and its prefix)
        alone. The [B, 1, S, S] mask itself is built only where a fallback asks for it
        (`.dense()`): at 1,700 positions it took ~2-5 ms a micro-batch, for nothing. Empty,
        so that a use of it as a mask fails instead of masking nothing."""
        mask = torch.empty(self.segments.shape[0], 1, 0, 0, dtype=torch.bool)
        mask.packed_spans = packed_spans(self.segments, self.trunks)
        mask.dense = self.dense_attention_mask
        return mask

    def dense_attention_mask(self) -> torch.Tensor:
        """[B, 1, S, S] bool, True = masked: causal within one sequence of the row, plus the
        whole shared prefix it extends."""
        seg = self.segments
        s = seg.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=seg.device).triu(1)
        other = seg[:, None, :, None] != seg[:, None, None, :]
        mask = other | causal
        if self.trunks is not None:  # a prefix's columns come before its branches: causal
            mask &= ~((self.trunks[:, None, :, None] == seg[:, None, None, :])
                      & (self.trunks[:, None, :, None] >= 0))
        return mask

    def per_sequence(self, out: torch.Tensor) -> torch.Tensor:
        """Model output [B, S, ...] → [n, L, ...] in `sources` order (zeros past each length)."""
        n = 0 if self.sources is None else self.sources.numel()
        if not self.packed:
            return out[:n]
        flat = out.reshape(-1, *out.shape[2:])
        picked = flat[self.unpack_index]
        keep = _arange_mask(self.lengths, self.unpack_index.shape[1])
        keep = keep.view(*keep.shape, *([1] * (picked.dim() - 2)))
        return torch.where(keep, picked, torch.zeros((), dtype=picked.dtype))


def packed_spans(segments: torch.Tensor, trunks: torch.Tensor | None = None
                 ) -> list[list[tuple[int, int, int, int]]]:
    """Per row of `segments` ([B, S], sequence slot or -1 = padding): each sequence's (start,
    end) columns, then those of the shared prefix it extends (`trunks`: that prefix's slot per
    column, -1 = none; an empty (start, start) span when none), in order."""
    out = []
    for b, row in enumerate(segments):  # runs of one slot, where the slot changes
        cuts = (row[1:] != row[:-1]).nonzero().flatten().add(1).tolist()
        bounds = [0, *cuts, row.numel()]
        slots = row[bounds[:-1]].tolist()
        runs = {slot: (a, e) for a, e, slot in zip(bounds, bounds[1:], slots, strict=False)
                if slot >= 0}
        parents = [-1] * len(slots) if trunks is None else trunks[b, bounds[:-1]].tolist()
        out.append([(a, e, *runs.get(parent, (a, a)))
                    for a, e, slot, parent in zip(bounds, bounds[1:], slots, parents,
                                                  strict=False) if slot >= 0])
    return out


def loss_inputs(mb: TokenBatch, out: torch.Tensor) -> tuple[TokenBatch, torch.Tensor]:
    """The batch and per-token output a loss sees: packed micro-batches are unpacked into
    their sequences first (a loss never sees two sequences in one row)."""
    if isinstance(mb, MicroBatch) and mb.packed:
        return mb.loss_view, mb.per_sequence(out)
    return mb, out


# -- planning ------------------------------------------------------------------------------
def effective_lengths(batch: TokenBatch) -> torch.Tensor:
    """Per row: index of the last trained target + 1 (0 when the row trains nothing)."""
    trained = batch.loss_mask > 0
    pos = torch.arange(1, batch.seq_length + 1).expand_as(trained)
    return torch.where(trained, pos, torch.zeros_like(pos)).amax(dim=1)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def balance_dp(lengths: list[int], dp: int) -> list[list[int]]:
    """Row ids per DP rank, longest-processing-time first: balanced by token count."""
    heap = [(0, 0, rank) for rank in range(dp)]
    out: list[list[int]] = [[] for _ in range(dp)]
    for row in sorted((r for r, n in enumerate(lengths) if n > 0),
                      key=lambda r: (-lengths[r], r)):
        tokens, count, rank = heapq.heappop(heap)
        out[rank].append(row)
        heapq.heappush(heap, (tokens + lengths[row], count + 1, rank))
    return out


# a shorter common opening is not worth a branch of its own
MIN_SHARED_TOKENS = 16
# per-token extras the model's forward reads from a micro-batch (routing replay)
FORWARD_EXTRAS = frozenset({ROUTED_EXPERTS})


@dataclass(frozen=True)
class PrefixGroup:
    """Batch rows packed behind one copy of the `trunk` tokens they all begin with (0: one row
    alone); the first row's copy is the one packed."""

    rows: tuple[int, ...]
    trunk: int = 0

    def tokens(self, lengths: list[int]) -> int:
        return self.trunk + sum(lengths[r] - self.trunk for r in self.rows)


def _first_trained(batch: TokenBatch) -> list[int]:
    """Per row: the first trained target's index (the row's length when none)."""
    trained = batch.loss_mask > 0
    first = torch.where(trained.any(dim=1), trained.int().argmax(dim=1),
                        torch.full((batch.rows,), batch.seq_length))
    return first.tolist()


def _common(batch: TokenBatch, a: int, b: int, limit: int) -> int:
    """How many leading positions rows `a` and `b` share (tokens, their targets, positions,
    and the extras the model's forward reads: the loss reads its own from each sequence's
    row), at most `limit`."""
    same = torch.ones(limit, dtype=torch.bool)
    for t in (batch.input_ids, batch.labels, batch.position_ids):
        same &= t[a, :limit] == t[b, :limit]
    for key in FORWARD_EXTRAS & batch.extras.keys():
        v = batch.extras[key]
        same &= (v[a, :limit] == v[b, :limit]).reshape(limit, -1).all(dim=1)
    differ = (~same).nonzero()
    return int(differ[0]) if differ.numel() else limit


def share_prefixes(batch: TokenBatch, row_ids: list[int], lengths: list[int], budget: int,
                   min_shared: int = MIN_SHARED_TOKENS) -> list[PrefixGroup]:
    """`row_ids` as groups that share their untrained openings (see the module docstring):
    sorted by that opening, each row joins the group before it while they still share
    `min_shared` tokens and the group's packed size stays within `budget`."""
    first = _first_trained(batch)
    ids = batch.input_ids
    order = sorted((r for r in row_ids if lengths[r] > 0),
                   key=lambda r: (ids[r, :first[r]].tolist(), r))
    groups: list[PrefixGroup] = []
    members: list[int] = []
    trunk = size = 0
    for r in order:
        if members:
            shared = _common(batch, members[0], r, min(trunk, first[r]))
            grown = size + (len(members) - 1) * (trunk - shared) + lengths[r] - shared
            if shared >= min_shared and grown <= budget:
                members.append(r)
                trunk, size = shared, grown
                continue
            groups.append(PrefixGroup(tuple(members), trunk if len(members) > 1 else 0))
        members, trunk, size = [r], first[r], lengths[r]
    if members:
        groups.append(PrefixGroup(tuple(members), trunk if len(members) > 1 else 0))
    return groups


@dataclass
class Plan:
    """One micro-batch: `width` tokens per row; each row lists the sequences it holds."""

    width: int
    rows: list[list[int]]

    @property
    def tokens(self) -> int:
        return self.width * len(self.rows)


def _descending(row_ids: list[int], lengths: list[int]) -> list[int]:
    return sorted((r for r in row_ids if lengths[r] > 0), key=lambda r: (-lengths[r], r))


def _width(order: list[int], lengths: list[int], budget: int, multiple: int) -> int:
    width = round_up(lengths[order[0]], multiple)
    if width > budget:
        log_once(f"train.max_tokens_per_microbatch={budget}: a sequence of "
                 f"{lengths[order[0]]} tokens gets a micro-batch of its own")
    return width


def _fill(order: list[int], lengths: list[int], width: int, max_rows: int, pack: bool
          ) -> tuple[list[list[int]], list[int]]:
    """One micro-batch of at most `max_rows` rows of `width` from `order` (longest first):
    first fit; returns its rows and the sequences left for later micro-batches."""
    rows: list[list[int]] = []
    free: list[int] = []
    rest: list[int] = []
    for r in order:
        n = lengths[r]
        if pack:
            slot = next((i for i, f in enumerate(free) if f >= n), None)
            if slot is not None:
                rows[slot].append(r)
                free[slot] -= n
                continue
        if len(rows) < max_rows and n <= width:
            rows.append([r])
            free.append(width - n)
        else:
            rest.append(r)
    return rows, rest


def plan_rank(row_ids: list[int], lengths: list[int], budget: int, multiple: int = 1,
              pack: bool = False) -> list[Plan]:
    """First-fit-decreasing micro-batches of one rank's rows (see the module docstring)."""
    order = _descending(row_ids, lengths)
    plans: list[Plan] = []
    while order:
        width = _width(order, lengths, budget, multiple)
        rows, order = _fill(order, lengths, width, max(1, budget // width), pack)
        plans.append(Plan(width, rows))
    return plans


def plan_lockstep(per_rank: list[list[int]], lengths: list[int], budget: int,
                  multiple: int = 1, pack: bool = False) -> list[list[Plan]]:
    """Like `plan_rank` on every rank at once, micro-batch i with one [rows, width] on all
    ranks (the width of the longest sequence left on any rank; filler rows = [])."""
    orders = [_descending(ids, lengths) for ids in per_rank]
    plans: list[list[Plan]] = [[] for _ in per_rank]
    while any(orders):
        width = max(_width(o, lengths, budget, multiple) for o in orders if o)
        filled = [_fill(o, lengths, width, max(1, budget // width), pack) for o in orders]
        nrows = max(1, max(len(rows) for rows, _ in filled))
        for k, (rows, rest) in enumerate(filled):
            plans[k].append(Plan(width, rows + [[]] * (nrows - len(rows))))
            orders[k] = rest
    return plans


def plan_batch(lengths: list[int], dp: int, budget: int, multiple: int = 1,
               pack: bool = False, uniform: bool = False,
               per_rank: list[list[int]] | None = None) -> list[list[Plan | None]]:
    """Every DP rank's micro-batches, the same count on each (None = an empty micro-batch).
    `uniform`: micro-batch i has the same [rows, width] on every rank (`plan_lockstep`).
    `per_rank`: each rank's sequences when already split (else `balance_dp`)."""
    per_rank = balance_dp(lengths, dp) if per_rank is None else per_rank
    if uniform:
        plans = plan_lockstep(per_rank, lengths, budget, multiple, pack)
        return plans if plans[0] else [[None] for _ in plans]
    planned = [plan_rank(ids, lengths, budget, multiple, pack) for ids in per_rank]
    count = max(1, max(len(p) for p in planned))
    return [p + [None] * (count - len(p)) for p in planned]


# -- building ------------------------------------------------------------------------------
def _arange_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    return torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)


def _gather(batch: TokenBatch, src_row: torch.Tensor, src_col: torch.Tensor,
            valid: torch.Tensor) -> dict[str, Any]:
    """TokenBatch fields at (src_row, src_col) per output position; zeros where not valid."""
    def take(t: torch.Tensor, pad: float = 0) -> torch.Tensor:
        out = t[src_row, src_col]
        keep = valid.view(*valid.shape, *([1] * (out.dim() - 2)))
        return torch.where(keep, out, torch.full((), pad, dtype=out.dtype))

    return dict(input_ids=take(batch.input_ids), labels=take(batch.labels),
                loss_mask=take(batch.loss_mask), position_ids=take(batch.position_ids),
                extras={k: take(v, PAD_VALUES.get(k, 0)) for k, v in batch.extras.items()})


def trimmed_rows(batch: TokenBatch, rows: list[int], lengths: list[int], width: int,
                 total_rows: int | None = None) -> MicroBatch:
    """`rows` as [total_rows, width] (one sequence per row, filler rows after them)."""
    total = len(rows) if total_rows is None else total_rows
    ids = torch.tensor(rows + [0] * (total - len(rows)), dtype=torch.long)
    lens = torch.tensor([lengths[r] for r in rows] + [0] * (total - len(rows)))
    col = torch.arange(width).expand(total, width)
    valid = _arange_mask(lens, width)
    src_col = col.clamp(max=batch.seq_length - 1)
    fields = _gather(batch, ids.unsqueeze(1).expand(total, width), src_col, valid)
    return MicroBatch(**fields, sources=ids[:len(rows)], lengths=lens[:len(rows)], valid=valid)


def packed_rows(batch: TokenBatch, rows: list[list[PrefixGroup]], lengths: list[int],
                width: int, total_rows: int | None = None) -> MicroBatch:
    """Sequences concatenated per row (position ids restart per sequence), [total_rows, width];
    a group's shared prefix once, before its members' remainders."""
    total = len(rows) if total_rows is None else total_rows
    src_row = torch.zeros(total, width, dtype=torch.long)
    src_col = torch.zeros(total, width, dtype=torch.long)
    segments = torch.full((total, width), -1, dtype=torch.long)
    trunks = torch.full((total, width), -1, dtype=torch.long)
    order: list[int] = []
    where: list[torch.Tensor] = []  # per sequence: the flat columns of its tokens, in order
    for b, groups in enumerate(rows):
        offset = slot = 0
        for g in groups:
            t, shared, trunk_slot = g.trunk, torch.arange(0), slot
            if t:
                src_row[b, offset:offset + t] = g.rows[0]
                src_col[b, offset:offset + t] = torch.arange(t)
                segments[b, offset:offset + t] = slot
                shared = b * width + offset + torch.arange(t)
                offset, slot = offset + t, slot + 1
            for r in g.rows:
                n = lengths[r] - t
                src_row[b, offset:offset + n] = r
                src_col[b, offset:offset + n] = torch.arange(t, t + n)
                segments[b, offset:offset + n] = slot
                if t:
                    trunks[b, offset:offset + n] = trunk_slot
                order.append(r)
                where.append(torch.cat([shared, b * width + offset + torch.arange(n)]))
                offset, slot = offset + n, slot + 1
    valid = segments >= 0
    fields = _gather(batch, src_row, src_col, valid)
    lens = torch.tensor([lengths[r] for r in order], dtype=torch.long)
    longest = int(lens.max()) if order else 0
    index = torch.zeros(len(order), longest, dtype=torch.long)
    for k, cols in enumerate(where):
        index[k, :cols.numel()] = cols
    view = trimmed_rows(batch, order, lengths, longest)
    return MicroBatch(**fields, sources=lens.new_tensor(order), lengths=lens, valid=valid,
                      segments=segments, trunks=trunks if (trunks >= 0).any() else None,
                      unpack_index=index, loss_view=view)


def empty_micro_batch(batch: TokenBatch, width: int, rows: int = 1) -> MicroBatch:
    """Fully masked padding rows (keep the DP ranks' micro-batch counts equal); every extra
    is present, as zeros, so losses find the keys they read."""
    return trimmed_rows(batch, [], [], width, total_rows=rows)


def build(batch: TokenBatch, plan: Plan | None, groups: list[PrefixGroup],
          lengths: list[int], pack: bool, multiple: int) -> MicroBatch:
    """The micro-batch `plan` lays out; its rows list indices into `groups`."""
    if plan is None:
        return empty_micro_batch(batch, multiple)
    if not any(plan.rows):
        return empty_micro_batch(batch, plan.width, len(plan.rows))
    seqs = [[groups[g] for g in r] for r in plan.rows if r]
    if pack:
        return packed_rows(batch, seqs, lengths, plan.width, total_rows=len(plan.rows))
    return trimmed_rows(batch, [r[0].rows[0] for r in seqs], lengths, plan.width,
                        total_rows=len(plan.rows))


def micro_batches(batch: TokenBatch, *, dp: int, dp_rank: int, budget: int, multiple: int = 1,
                  pack: bool = False, uniform: bool = False, share: bool = False
                  ) -> list[MicroBatch]:
    """This DP rank's micro-batches of the global `batch` (the same call on every rank).
    `share` (with `pack`): rows that begin alike share one copy of that prefix."""
    lengths = effective_lengths(batch).tolist()
    per_rank = balance_dp(lengths, dp)
    if pack and share:
        groups, ranks = [], []
        for rows in per_rank:
            mine = share_prefixes(batch, rows, lengths, budget)
            ranks.append(list(range(len(groups), len(groups) + len(mine))))
            groups += mine
        per_rank = ranks
    else:
        groups = [PrefixGroup((r,)) for r in range(batch.rows)]
    sizes = [g.tokens(lengths) for g in groups]
    plans = plan_batch(sizes, dp, budget, multiple, pack, uniform, per_rank)
    return [build(batch, p, groups, lengths, pack, multiple) for p in plans[dp_rank]]


def assemble(batch: TokenBatch, micro: list[MicroBatch], outputs: list[torch.Tensor]
             ) -> torch.Tensor:
    """Per-token outputs of this rank's micro-batches back into [rows, seq, ...] of the
    original batch (zeros for rows other ranks hold and past each row's effective length)."""
    full = None
    for mb, out in zip(micro, outputs, strict=True):
        if full is None:
            full = out.new_zeros(batch.rows, batch.seq_length, *out.shape[2:])
        if mb.empty:
            continue
        seq = mb.per_sequence(out)
        keep = _arange_mask(mb.lengths, seq.shape[1])
        r = mb.sources.unsqueeze(1).expand_as(keep)
        c = torch.arange(seq.shape[1]).expand_as(keep)
        full[r[keep], c[keep]] = seq[keep]
    return full


# -- model support -------------------------------------------------------------------------
def packing_unsupported(spec: Any, cfg: Any) -> str | None:
    """Why this model/layout cannot run packed rows here (None = it can)."""
    from megatron_rl.models.builder import use_transformer_engine

    if spec.linear_attention is not None:
        return ("Gated DeltaNet (linear attention) layers carry their recurrent state across a "
                "packed row: no per-sequence reset on CPU")
    if spec.mtp_num_layers:
        return "multi-token prediction shifts tokens across the sequences of a packed row"
    if cfg.parallel.cp > 1:
        return "context parallelism splits a packed row without per-sequence offsets"
    if use_transformer_engine(cfg.model):
        return ("Transformer Engine attention takes packed sequences as THD PackedSeqParams "
                "(cu_seqlens), which the actor does not build yet; the explicit block-diagonal "
                "mask is for the local DotProductAttention")
    return None


class RowPositionRoPE:
    """Makes a GPTModel's `RotaryEmbedding` follow per-token position ids while `positions`
    ([b, s]) is set; megatron's own RoPE always uses 0..s-1 per row.

    The table is megatron's (same values for the same position, whatever the row holds), so a
    sequence packed at offset o gets exactly the rotation it gets alone in a row."""

    def __init__(self, rope: torch.nn.Module):
        self._table = rope.forward  # megatron's (lru-cached) table for 0..n-1
        self.positions: torch.Tensor | None = None
        rope.forward = self  # an instance attribute shadows the class's forward

    def __call__(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                 cp_group: Any = None) -> torch.Tensor:
        if self.positions is None:
            return self._table(max_seq_len, offset, packed_seq, cp_group)
        pos = self.positions.long()
        if pos.shape[1] != max_seq_len or offset:
            raise RuntimeError(f"RoPE positions {tuple(pos.shape)} do not match a sequence of "
                               f"{max_seq_len} (offset {offset})")
        table = self._table(int(pos.max()) + 1, 0, packed_seq, cp_group)  # [P, 1, 1, d]
        return table[:, 0][pos.t()]  # [s, b, 1, d]: broadcast over heads
