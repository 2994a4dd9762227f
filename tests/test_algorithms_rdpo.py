"""RDPO per-turn advantages (role pools, mixed ablation), the simpler reward managers and the
mapping onto training tokens, on hand-computed cases."""

from __future__ import annotations

import pytest

from megatron_rl.algorithms.rdpo import (
    rdpo_advantages,
    token_advantages,
)
from megatron_rl.algorithms.reward_managers import turn_advantages
from megatron_rl.records.trajectory import Trajectory, Turn
from megatron_rl.rewards.composite import RewardWeights


def _turn(role: str, rubric: float | None = None, ctx: list[int] | None = None,
          out: list[int] | None = None, obs: list[int] | None = None) -> Turn:
    out = out or [7]
    return Turn(role, ctx or [1], out, [-0.1] * len(out), [0] * len(out),
                observation_ids=obs or [], rewards={} if rubric is None else {"rubric": rubric})


def _ps(uid: str, group: str, outcome: float, planner: float | None,
        synth: float | None, *labels: str) -> Trajectory:
    t = Trajectory(uid, group, "q", turns=[_turn("planner", planner), _turn("synthesizer", synth)],
                   rewards={"outcome": outcome})
    for label in labels:
        t.add_label(label)
    return t


# w_outcome 1, w_rubric 0.5:
#   t1 (outcome 1): planner 1 + 0.5 * 0.8 = 1.4, synthesizer 1 + 0.5 * 0.6 = 1.3
#   t2 (outcome 0): planner 0 + 0.5 * 0.4 = 0.2, synthesizer has no rubric -> 0.0
#   t3: search_error (excluded);  t4: alone in group h
TRAJS = [_ps("t1", "g", 1.0, 0.8, 0.6), _ps("t2", "g", 0.0, 0.4, None),
         _ps("t3", "g", 1.0, 1.0, 1.0, "search_error"), _ps("t4", "h", 1.0, 0.5, 0.5)]
W = RewardWeights(outcome=1.0, rubric=0.5)


def _approx(rows):
    return [None if r is None else pytest.approx(r) for r in rows]


def test_rdpo_normalises_within_role_pools():
    # Dr.GRPO numbers: planner pool [1.4, 0.2], mean 0.8 -> [0.6, -0.6]
    #                  synthesizer pool [1.3, 0.0], mean 0.65 -> [0.65, -0.65]
    adv = rdpo_advantages(TRAJS, W, estimator="dr_grpo")
    assert adv[0] == pytest.approx([0.6, 0.65]) and adv[1] == pytest.approx([-0.6, -0.65])
    assert adv[2] == [None, None]                # env failure: no advantage, out of the loss
    assert adv[3] == [0.0, 0.0]                  # singleton pools
    # GRPO: any two-member pool is +-d / (sqrt(2) d) = +-0.707107 (unbiased std, eps 0)
    adv = rdpo_advantages(TRAJS, W, eps=0.0)
    assert adv[0] == pytest.approx([0.707107, 0.707107], abs=1e-6)


def test_mixed_roles_pools_all_turns():
    # all four turns [1.4, 1.3, 0.2, 0.0]: mean 2.9 / 4 = 0.725
    adv = rdpo_advantages(TRAJS, W, mixed_roles=True, estimator="dr_grpo")
    assert adv[0] + adv[1] == pytest.approx([0.675, 0.575, -0.525, -0.725])


def test_max_turns_switch_keeps_stats_masks_loss():
    trajs = [_ps("a", "g", 1.0, None, None), _ps("b", "g", 0.0, None, None, "max_turns")]
    # outcome only (no rubrics): both pools [1, 0] -> +-0.5; b masked out with the switch
    adv = rdpo_advantages(trajs, estimator="dr_grpo", exclude_max_turns_from_loss=True)
    assert adv == [[0.5, 0.5], [None, None]]


def test_simpler_managers():
    # pipeline outcome-only ignores the rubrics: pools [1, 0] in group g -> +-0.5
    adv, _ = turn_advantages("pipeline_outcome", TRAJS, estimator="dr_grpo")
    assert adv[:3] == [[0.5, 0.5], [-0.5, -0.5], [None, None]]
    # end-to-end: one advantage per trajectory over outcomes [1, 0] of group g (t3 excluded)
    adv, _ = turn_advantages("end_to_end", TRAJS, estimator="dr_grpo")
    assert adv == [[0.5, 0.5], [-0.5, -0.5], [None, None], [0.0, 0.0]]


def test_token_mapping_itersynth_and_react():
    # IterSynth: each turn starts a new sequence
    #   seq 0: [1, 2 | 3, 4]  turn_index [-1, -1, 0, 0];  seq 1: [5 | 6]  turn_index [-1, 1]
    t = Trajectory("x", "g", "q", turns=[_turn("planner", ctx=[1, 2], out=[3, 4]),
                                         _turn("synthesizer", ctx=[5], out=[6])])
    seqs = token_advantages(t.sequences(), [0.6, -0.65])
    assert [s.advantages.tolist() for s in seqs] == [[0, 0, 0.6, 0.6], [0, -0.65]]
    assert [s.loss_mask.tolist() for s in seqs] == [[0, 0, 1, 1], [0, 1]]
    # ReAct: one growing sequence [1 | 2 | obs 3 | 4], turn_index [-1, 0, -1, 1]
    r = Trajectory("y", "g", "q", turns=[_turn("agent", ctx=[1], out=[2], obs=[3]),
                                         _turn("agent", ctx=[1, 2, 3], out=[4])])
    (seq,) = token_advantages(r.sequences(), [0.3, None])  # turn 1 not trained
    assert seq.advantages.tolist() == [0, 0.3, 0, 0] and seq.loss_mask.tolist() == [0, 1, 0, 0]


def test_a_dropped_group_kept_for_the_synthesizer_trains_only_its_turns():
    """`rl.sampling.dropped_group_roles=[synthesizer]`: in a group whose outcomes are all equal
    the Synthesizer's turns are ranked by their rubric scores alone; the Planner's leave the
    loss, and so do their rows (a row with no trained token is not in the batch)."""
    from megatron_rl.config.schema import RLConfig
    from megatron_rl.trainer.batching import rl_batch

    group = [_ps(f"u{i}", "g", 0.0, 0.2 * i, s) for i, s in enumerate((0.9, 0.1, 0.5))]
    rl = RLConfig(reward_manager="rdpo", rubric_weight=0.5)
    full, _ = rl_batch(group, rl, seq_length=8, rows_multiple=1)
    for t in group:
        t.metadata["trained_roles"] = ["synthesizer"]
    batch, _ = rl_batch(group, rl, seq_length=8, rows_multiple=1)
    assert full.rows == 6 and batch.rows == 3           # the planner's three rows are gone
    adv = [t.metadata["turn_advantages"] for t in group]
    assert [a[0] for a in adv] == [None, None, None]
    synth = [a[1] for a in adv]
    assert synth[0] > synth[2] > synth[1] and sum(synth) == pytest.approx(0.0, abs=1e-6)
