"""Token-budget micro-batches and sequence packing: the planner's guarantees (no model), then
the same log-probs, losses (every aggregation mode) and gradients as the fixed micro-batches on
a real Megatron tiny-moe, at 1 process and at DP2 / EP2 / TP2+SP."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_rl.records.batch import TokenBatch
from megatron_rl.trainer import microbatching as mbs
from tests import microbatch_cases as cases
from tests.pools import get_pool

TOL = 1e-5
MODES_BUDGET = {m: v.get("max_tokens_per_microbatch", 0) for m, v in cases.MODES.items()}


def heavy_tailed(n: int, seed: int, longest: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [min(longest, max(1, int(rng.lognormvariate(3.5, 1.0)))) for _ in range(n)]


# -- planning (no model) -------------------------------------------------------------------
def test_dp_split_balances_tokens_not_rows():
    lengths = [400] + [10] * 40
    ranks = mbs.balance_dp(lengths, 2)
    tokens = [sum(lengths[r] for r in rows) for rows in ranks]
    assert sorted(tokens) == [400, 400]  # 1 long row vs 40 short ones
    assert sorted(len(r) for r in ranks) == [1, 40]
    lengths = heavy_tailed(200, seed=1)
    for dp in (2, 3, 4):
        tokens = [sum(lengths[r] for r in rows) for rows in mbs.balance_dp(lengths, dp)]
        assert max(tokens) - min(tokens) <= max(lengths)  # LPT bound


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("dp,multiple,uniform", [(1, 1, False), (2, 2, False), (3, 1, False),
                                                 (2, 2, True)])
def test_plans_fit_the_budget_cover_every_row_once_and_match_counts(pack, dp, multiple,
                                                                    uniform):
    lengths = [*heavy_tailed(150, seed=dp), 0, 0]  # rows that train nothing are skipped
    budget = 1024
    plans = mbs.plan_batch(lengths, dp, budget, multiple, pack, uniform)
    assert len({len(p) for p in plans}) == 1  # same micro-batch count on every DP rank
    seen = []
    for rank in plans:
        for plan in rank:
            if plan is None:
                continue
            assert plan.width % multiple == 0 and plan.tokens <= budget
            for row in plan.rows:
                assert sum(lengths[r] for r in row) <= plan.width
                assert pack or len(row) <= 1
                seen += row
    assert sorted(seen) == [r for r, n in enumerate(lengths) if n > 0]
    if uniform:  # micro-batch i has one shape on every rank (allgather dispatcher + EP)
        for i in range(len(plans[0])):
            assert len({(p[i].width, len(p[i].rows)) for p in plans}) == 1


def test_packing_beats_padding_on_heavy_tailed_lengths():
    lengths = heavy_tailed(200, seed=3)
    used = {}
    for pack in (False, True):
        plans = mbs.plan_rank(list(range(len(lengths))), lengths, 2048, 1, pack)
        used[pack] = sum(p.tokens for p in plans)
    assert sum(lengths) <= used[True] < used[False] < len(lengths) * max(lengths)


def test_a_row_longer_than_the_budget_gets_its_own_micro_batch():
    plans = mbs.plan_rank([0, 1, 2], [300, 20, 10], budget=128, multiple=8)
    assert [(p.width, p.rows) for p in plans] == [(304, [[0]]), (24, [[1], [2]])]


def small_batch() -> TokenBatch:
    g = torch.Generator().manual_seed(0)
    lengths = [7, 3, 0, 5]
    tokens = torch.randint(1, 50, (4, 11), generator=g)
    mask = torch.zeros(4, 11)
    for i, n in enumerate(lengths):
        mask[i, 1:n + 1] = 1.0  # targets 0..n-1; the first is prompt
    adv = torch.arange(44, dtype=torch.float).view(4, 11)
    batch = TokenBatch.from_sequences(tokens, mask, advantages=adv)
    batch.extras["routed_experts"] = torch.randint(0, 4, (4, 10, 2, 2), generator=g)
    return batch


def test_packed_rows_restart_positions_and_pack_every_extra_alike():
    batch = small_batch()
    lengths = mbs.effective_lengths(batch).tolist()
    assert lengths == [7, 3, 0, 5]
    one = mbs.PrefixGroup
    mb = mbs.packed_rows(batch, [[one((0,)), one((1,))], [one((3,))]], lengths, width=10)
    assert mb.sources.tolist() == [0, 1, 3] and mb.lengths.tolist() == [7, 3, 5]
    assert mb.segments.tolist() == [[0] * 7 + [1] * 3, [0] * 5 + [-1] * 5]
    assert mb.position_ids[0].tolist() == list(range(7)) + list(range(3))
    for key, t in [("input_ids", mb.input_ids), ("labels", mb.labels),
                   ("advantages", mb.extras["advantages"]),
                   ("routed_experts", mb.extras["routed_experts"])]:
        src = batch.extras[key] if key in batch.extras else getattr(batch, key)
        assert torch.equal(t[0, :7], src[0, :7]) and torch.equal(t[0, 7:], src[1, :3]), key
        assert torch.equal(t[1, :5], src[3, :5]), key
    assert (mb.extras["routed_experts"][1, 5:] == -1).all()  # padding: the model routes it
    assert (mb.loss_mask[1, 5:] == 0).all() and not mb.valid[1, 5:].any()
    # block-diagonal causal: row 0's second sequence sees only itself
    full = mb.dense_attention_mask()
    mask = full[0, 0]
    assert mask[8].tolist() == [True] * 7 + [False, False, True]
    # the model gets its sequences by name, for an attention that computes them one by one,
    # and the dense mask only on demand (an empty tensor: used as a mask, it fails)
    given = mb.attention_mask()
    assert given.packed_spans == [[(0, 7, 0, 0), (7, 10, 7, 7)], [(0, 5, 0, 0)]]
    assert given.shape == (2, 1, 0, 0) and torch.equal(given.dense(), full)
    assert mbs.packed_spans(torch.tensor([[-1, 0, 0, 1, -1, 2], [-1] * 6])) == [
        [(1, 3, 1, 1), (3, 4, 3, 3), (5, 6, 5, 5)], []]
    assert mask[3].tolist() == [False] * 4 + [True] * 6
    # the loss sees the sequences as ordinary rows: the model output unpacked onto them
    out = mb.input_ids.float().unsqueeze(-1)
    view, seq = mbs.loss_inputs(mb, out)
    assert torch.equal(seq[..., 0].long(), view.input_ids)
    assert torch.equal(view.loss_mask, batch.loss_mask[[0, 1, 3], :7])


def test_results_come_back_in_row_order_and_shape_whatever_the_rank_and_packing():
    batch = small_batch()
    for pack in (False, True):
        full = torch.zeros(batch.rows, batch.seq_length)
        for rank in range(2):
            micro = mbs.micro_batches(batch, dp=2, dp_rank=rank, budget=12, multiple=2,
                                      pack=pack)
            outs = [mb.input_ids.float().unsqueeze(-1) for mb in micro]
            full += mbs.assemble(batch, micro, outs)[..., 0]
        lengths = mbs.effective_lengths(batch)
        keep = torch.arange(batch.seq_length) < lengths.unsqueeze(1)
        assert torch.equal(full.long(), torch.where(keep, batch.input_ids, 0)), pack


def test_empty_micro_batch_is_fully_masked_and_keeps_the_extras():
    batch = small_batch()
    # one long row on one DP rank, the short ones on the other: counts differ, padded
    micro = [mbs.micro_batches(batch, dp=2, dp_rank=r, budget=8, multiple=2) for r in (0, 1)]
    assert len(micro[0]) == len(micro[1]) == 2
    empty = [mb for m in micro for mb in m if mb.empty]
    assert len(empty) == 1 and empty[0].loss_mask.sum() == 0
    assert set(empty[0].extras) == set(batch.extras)
    assert (empty[0].extras["routed_experts"] == -1).all()


def prefixed_batch() -> TokenBatch:
    """Rows 0-3 open with the same 20 untrained tokens (row 3 with the same first 30),
    row 4 with only 10 of them, row 5 with its own; every row trains 8 targets after them."""
    g = torch.Generator().manual_seed(5)
    opening = [20, 20, 20, 20, 10, 0]
    tokens = torch.randint(1, 500, (6, 41), generator=g)
    tokens[3, :30] = tokens[0, :30]
    mask = torch.zeros(6, 41)
    for row, n in enumerate(opening):
        tokens[row, :n] = tokens[0, :n]
        mask[row, 21 + (row == 3) * 10:29 + (row == 3) * 10] = 1.0
    tokens[4, 10] = 999  # row 4 sorts after the others
    return TokenBatch.from_sequences(tokens, mask)


def test_rows_that_open_alike_share_one_copy_of_the_opening_within_the_budget():
    batch = prefixed_batch()
    lengths = mbs.effective_lengths(batch).tolist()
    assert lengths == [28, 28, 28, 38, 28, 28]
    groups = mbs.share_prefixes(batch, list(range(6)), lengths, budget=1000)
    # the common opening stops where the targets part (19: the first trained target is the
    # 21st token), though row 3 shares 30 tokens with row 0; 10 are below the minimum
    groups.sort(key=lambda g: g.rows[0])
    assert groups == [mbs.PrefixGroup((0, 1, 2, 3), 19), mbs.PrefixGroup((4,)),
                      mbs.PrefixGroup((5,))]
    assert groups[0].tokens(lengths) == 19 + 9 * 3 + 19
    # a budget of 60 tokens holds the opening and three remainders at most
    small = mbs.share_prefixes(batch, [0, 1, 2, 3], lengths, budget=60)
    assert [g.rows for g in small] == [(0, 1, 2), (3,)]
    assert all(g.tokens(lengths) <= 60 for g in small)
    # an extra that differs inside the opening (the engine routed a token otherwise) cuts it
    batch.extras["routed_experts"] = torch.zeros(6, 40, 2, 2, dtype=torch.long)
    batch.extras["routed_experts"][1, 12] = 1
    cut = mbs.share_prefixes(batch, [0, 1], lengths, budget=1000)
    assert [g.rows for g in cut] == [(0,), (1,)]


def test_a_shared_opening_packs_once_and_each_branch_sees_it():
    batch = prefixed_batch()
    micro = mbs.micro_batches(batch, dp=1, dp_rank=0, budget=1000, pack=True, share=True)
    assert len(micro) == 1
    mb = micro[0]
    assert int(mb.valid.sum()) == 19 + 9 * 3 + 19 + 28 + 28  # not 6 rows' 178
    # every sequence comes back whole: its opening from the shared copy
    for key in ("input_ids", "position_ids", "loss_mask"):
        got = mb.per_sequence(getattr(mb, key).unsqueeze(-1))[..., 0]
        for k, row in enumerate(mb.sources.tolist()):
            n = int(mb.lengths[k])
            assert torch.equal(got[k, :n], getattr(batch, key)[row, :n]), (key, row)
    # branch 2 (row 1's remainder, columns 28-36) attends to the opening and to itself only
    mask = mb.attention_mask()
    assert mask.packed_spans[0][:3] == [(0, 19, 0, 0), (19, 28, 0, 19), (28, 37, 0, 19)]
    allowed = ~mask.dense()[0, 0, 30]
    assert allowed[:19].all() and not allowed[19:28].any() and allowed[28:31].all()
    assert not allowed[31:].any()


# -- on a real model -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    init = str(tmp_path_factory.mktemp("microbatching") / "init")
    pool = get_pool(1)
    pool.run(cases.save_initial, init)
    return init, pool.run(cases.compare_modes, [], init)[0]


def effective_mask() -> torch.Tensor:
    lengths = mbs.effective_lengths(cases.rl_batch())
    return torch.arange(cases.SEQ) < lengths.unsqueeze(1)


def assert_same(got: dict, ref: dict, what: str) -> None:
    keep = effective_mask()
    for key in ("logprobs", "entropy", "after"):
        diff = (got[key] - ref[key])[keep].abs().max().item()
        assert diff < TOL, (what, key, diff)
        assert (got[key][~keep] == 0).all(), (what, key)  # past a row's last trained token
    for key in ("loss", "grad_norm", "num_tokens", "lm_loss", "lm_grad_norm"):
        assert abs(got[key] - ref[key]) <= TOL * max(1.0, abs(ref[key])), (what, key)
    for i, (a, b) in enumerate(zip(got["evals"], ref["evals"], strict=True)):
        assert abs(a - b) <= TOL * max(1.0, abs(b)), (what, cases.AGG[i])


def test_one_process_budget_and_packing_match_fixed_micro_batches(runs):
    _, out = runs
    ref = out["fixed"]
    print("\n" + "\n".join(f"{m}: micro {v['micro']} loss {v['loss']:.8f} "
                           f"grad_norm {v['grad_norm']:.8f}" for m, v in out.items()))
    assert len(ref["micro"]) == 12 and ref["micro"][0] == (1, 64)
    assert out["budget"]["pack"] is False and out["packed"]["pack"] is True
    for mode in ("budget", "packed", "shared"):
        assert all(r * s <= MODES_BUDGET[mode] for r, s in out[mode]["micro"])
        assert_same(out[mode], ref, mode)
    assert out["packed"]["seqs_per_row"] >= 3  # rows really hold several sequences
    # packed rows are attended sequence by sequence, the other modes through plain SDPA
    assert out["packed"]["sequence_attention_calls"] > 0
    assert out["budget"]["sequence_attention_calls"] == 0
    assert len(out["packed"]["micro"]) < len(out["budget"]["micro"])
    # rows 0, 2, 6, 8 and 11 open with the same 20 prompt tokens, the first 19 with the same
    # targets: two groups of them (the budget) run those once, 3 - 1 and 2 - 1 copies fewer
    assert out["packed"]["tokens"] - out["shared"]["tokens"] == 19 * 3



def test_an_attention_falling_back_gets_the_dense_packed_mask(runs):
    """The packed mask is built only on demand: the per-sequence attention never asks, and
    megatron's own attention (here: attention dropout while training) gets the dense one."""
    init, _ = runs
    got = get_pool(1).run(cases.fallback_attention_masks, init)[0]
    assert got["spans_path_parent_calls"] == 0 and got["fallback_calls"] == 1
    assert got["dense"] and got["out_shape"] == got["expected"]


@pytest.mark.parametrize("layout", [[], ["parallel.ep=2"], ["parallel.tp=2"],
                                    ["parallel.ep=2", "parallel.moe_dispatcher=allgather"],
                                    ["parallel.pp=2"]],
                         ids=["dp2", "ep2", "tp2-sp", "ep2-allgather", "pp2"])
def test_two_ranks_match_one_process_fixed(layout, runs):
    init, out = runs
    ref = out["fixed"]
    got = get_pool(2).run(cases.compare_modes, layout, init, cases.NO_AUX,
                          ("budget", "packed", "shared"))
    for rank, result in enumerate(got):
        for mode, res in result.items():
            assert_same(res, ref, f"{layout} rank {rank} {mode}")
        assert result["packed"]["sequence_attention_calls"] > 0


def test_linear_attention_falls_back_to_padding(tmp_path):
    init = str(tmp_path / "init")
    pool = get_pool(1)
    spec = {"mtp_num_layers": 0}  # its loss covers padding positions (see microbatch_cases)
    pool.run(cases.save_initial, init, "tiny-qwen3.5", spec)
    out = pool.run(cases.compare_modes, [], init, spec, ("fixed", "packed"), "tiny-qwen3.5")[0]
    assert out["packed"]["pack"] is False and out["packed"]["seqs_per_row"] == 1
    assert any("Gated DeltaNet" in m for m in out["packed"]["logged"])
    assert_same(out["packed"], out["fixed"], "tiny-qwen3.5")


@pytest.mark.parametrize("world,layout", [(1, []), (2, ["parallel.ep=2"])], ids=["ws1", "ep2"])
def test_routing_replay_extras_are_packed_with_their_tokens(world, layout, runs):
    init, _ = runs
    out = get_pool(world).run(cases.replay_modes, layout, init)[0]
    fixed, packed = out["fixed"], out["packed"]
    keep = effective_mask()
    assert packed["pack"] is True
    # replay changes the routing (and so the log-probs) ...
    assert (fixed["replayed"] - fixed["natural"])[keep].abs().max() > 1e-2
    # ... and packing replays each token's own experts
    for key in ("natural", "replayed"):
        assert (packed[key] - fixed[key])[keep].abs().max() < TOL, key
    for key in ("loss", "grad_norm"):
        assert abs(packed[key] - fixed[key]) <= TOL * max(1.0, abs(fixed[key])), key


def test_router_aux_loss_leaves_padding_out_and_runs_everywhere(runs):
    """With the MoE load-balancing loss on (megatron's padding_mask keeps padding out of it,
    also through the sequence-parallel scatter) the policy loss is unchanged; the aux loss
    itself is per micro-batch, so gradients move with the grouping, a little."""
    init, out = runs
    ref = get_pool(1).run(cases.compare_modes, [], init, None, ("budget",))[0]["budget"]
    got = get_pool(2).run(cases.compare_modes, ["parallel.tp=2"], init, None,
                          ("budget", "packed"))[0]
    for mode, res in got.items():
        assert abs(res["loss"] - out["fixed"]["loss"]) < TOL, mode
        assert abs(res["grad_norm"] - ref["grad_norm"]) < 1e-3 * ref["grad_norm"], mode
    assert ref["grad_norm"] != out["budget"]["grad_norm"]  # the aux loss is there
