"""A GRPO update of the Megatron policy on a rollout batch: the same numbers at 1 and 2 ranks,
and it moves probability the way the advantages say."""

from __future__ import annotations

import math

import pytest
import torch

from tests import dist_cases, rl_cases
from tests.pools import get_pool

TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    init = str(tmp_path_factory.mktemp("rl") / "init")
    get_pool(1).run(dist_cases.save_initial, init, [f"model.seq_length={rl_cases.SEQ}"])
    return init, get_pool(1).run(rl_cases.update, [], init)[0]


def test_batch_carries_advantages_and_rollout_logprobs():
    batch, adv = rl_cases.rollout_batch()
    assert batch.input_ids.shape == (4, rl_cases.SEQ)
    # rewards (1, 0, 0, 1): mean 0.5, unbiased std 0.577 → ±0.866
    assert [a[0] for a in adv] == pytest.approx([0.866, -0.866, -0.866, 0.866], abs=1e-3)
    trained = batch.loss_mask.bool()
    assert trained.sum(1).tolist() == [12, 14, 16, 18]  # each row's generated tokens
    row_adv = [set(batch.extras["advantages"][i][trained[i]].tolist()) for i in range(4)]
    assert [len(s) for s in row_adv] == [1, 1, 1, 1]
    assert (batch.extras["rollout_logprobs"][trained] < -5).all()


def test_update_moves_probability_with_the_advantage(reference):
    _, ref = reference
    print(f"\nws1: {ref}")
    assert ref["grad_norm"] > 0
    up, down = ref["row_delta"][0] + ref["row_delta"][3], ref["row_delta"][1] + ref["row_delta"][2]
    assert up > 0 > down
    assert ref["mismatch/rollout_is_mean"] > 0
    assert ref["mismatch/train_rollout_logprob_abs_diff"] > 0


@pytest.mark.parametrize("layout", [["parallel.ep=2"], ["parallel.tp=2"]])
def test_two_ranks_match_one(layout, reference):
    init, ref = reference
    for got in get_pool(2).run(rl_cases.update, layout, init):
        for key in ("loss", "grad_norm", "mismatch/rollout_is_mean"):
            assert abs(got[key] - ref[key]) <= TOL * max(1.0, abs(ref[key])), (layout, key)


def test_with_no_advantage_only_the_load_balancing_loss_moves_weights(reference):
    """All rewards equal: the policy loss is 0, yet Adam turns the MoE load-balancing
    gradient alone into lr-sized steps of the router and every weight before it (what made
    RL from SFT drift, docs/algorithms.md). `model.router_aux_loss_coef=0` (the RL recipes')
    leaves the weights exactly as they were."""
    init, _ = reference
    lr = 1e-3
    with_aux = get_pool(1).run(rl_cases.zero_advantage_drift, [f"optim.lr={lr}"], init)[0]
    print(f"\nzero advantages, aux on: {with_aux}")
    assert with_aux["loss"] == 0.0
    assert with_aux["router_change"] > 0.5 * lr and with_aux["max_change"] > 0.5 * lr
    off = get_pool(1).run(rl_cases.zero_advantage_drift,
                          [f"optim.lr={lr}", "model.router_aux_loss_coef=0"], init)[0]
    assert off["max_change"] == 0.0 and off["loss"] == 0.0


def test_one_mini_batch_skips_the_old_logprob_pass_and_keeps_the_numbers(reference):
    """One mini-batch, one epoch: the old log-probs are the training pass's own (no separate
    forward), and the loss, gradient, TIS metrics and the weights after the step are those of
    the two-pass update."""
    init, _ = reference
    got = get_pool(1).run(rl_cases.one_step_as_before, [], init)[0]
    fast, two_pass = got["policy_update"], got["train_step"]
    print(f"\none pass: {fast}\ntwo passes: {two_pass}")
    assert fast["forward_passes"] == 0
    assert fast["ratio"] == 1.0 and fast["ppo_kl"] == 0.0
    for key in ("loss", "grad_norm", "lr", "step", "num_tokens", "mismatch/rollout_is_mean",
                "mismatch/rollout_is_eff_sample_size", "mismatch/rollout_is_clipped_fraction",
                "mismatch/train_rollout_logprob_abs_diff"):
        assert fast[key] == pytest.approx(two_pass[key], rel=1e-5, abs=1e-7), key
    assert 0 < fast["mismatch/rollout_is_eff_sample_size"] <= 1
    after = [x for row in fast["after"] for x in row]
    assert after == pytest.approx([x for row in two_pass["after"] for x in row], abs=1e-5)


@pytest.mark.parametrize("layout", [[], ["train.max_tokens_per_microbatch=32"]])
def test_old_logprobs_cover_the_trained_targets_only(layout, reference):
    """The old-log-prob pass runs the output layer over the trained targets only (as training
    does): the same numbers there, 0 elsewhere."""
    init, _ = reference
    got = get_pool(1).run(rl_cases.trained_only_logprobs, layout, init)[0]
    m = got["mask"]
    assert torch.allclose(got["trained"][m], got["full"][m], atol=1e-6)
    assert (got["trained"][~m] == 0).all() and (got["full"][~m] != 0).any()


def test_clip_binds_on_the_second_mini_batch(reference):
    init, _ = reference
    got = get_pool(1).run(rl_cases.mini_batch_steps, ["optim.lr=0.05"], init, 2)[0]
    first, second = got["steps"]
    print(f"\nmini-batch 1: {first}\nmini-batch 2: {second}")
    assert got["optimizer_steps"] == 2 and got["metrics"]["step"] == 1.0
    # the old log-probs are the weights that take the first step: ratio exactly 1
    assert first["ratio"] == 1.0 and first["pg_clipfrac"] == 0.0 and first["ppo_kl"] == 0.0
    # the second sees how far the first moved the policy, and the clip binds
    assert second["ratio"] != 1.0 and second["pg_clipfrac"] > 0 and second["ppo_kl"] != 0
    # ppo_kl is verl's k1, mean(old - logp): Jensen bounds the mean ratio by exp(-ppo_kl)
    assert second["ratio"] >= math.exp(-second["ppo_kl"])
    assert first["num_tokens"] + second["num_tokens"] == 12 + 14 + 16 + 18


def test_ppo_epochs_repeat_the_mini_batches(reference):
    init, _ = reference
    got = get_pool(1).run(rl_cases.mini_batch_steps, [], init, 2, 2)[0]
    assert got["optimizer_steps"] == 4 and len(got["steps"]) == 4
    assert [s["num_tokens"] for s in got["steps"]] == [26, 34, 26, 34]  # rows (0, 1), (2, 3)


def test_token_metrics_are_token_means_in_a_seq_mode(reference):
    # seq-mean-token-sum: the loss count is rows (2 per mini-batch), the token metrics are
    # still divided by the trained tokens (26, then 34)
    init, _ = reference
    got = get_pool(1).run(rl_cases.mini_batch_steps, ["optim.lr=0.05"], init, 2, 1,
                          "seq-mean-token-sum")[0]
    first, second = got["steps"]
    print(f"\nseq-mean-token-sum: {first}\n{second}")
    assert first["num_tokens"] == second["num_tokens"] == 2  # rows, not tokens
    assert first["ratio"] == 1.0 and first["pg_clipfrac"] == 0.0 and first["ppo_kl"] == 0.0
    assert 0.0 <= second["pg_clipfrac"] <= 1.0 and 0.0 <= second["pg_clipfrac_lower"] <= 1.0
    assert second["ratio"] == pytest.approx(1.0, abs=0.5)  # a mean ratio, not a sum per row


def test_the_worker_takes_the_recipes_mini_batches_with_token_budget(reference):
    # rl.mini_batches_per_step=2 through TrainerWorker.update; a 32-token budget holds one
    # row (20-26 tokens) per micro-batch, so each mini-batch runs 2 micro-batches
    init, _ = reference
    got = get_pool(1).run(rl_cases.worker_update, ["rl.mini_batches_per_step=2",
                                                   "train.max_tokens_per_microbatch=32"],
                          init)[0]
    m = got["metrics"]
    print(f"\nworker update: {m}")
    assert got["optimizer_steps"] == 2 and m["optimizer_steps"] == 2.0
    assert got["step"] == 1 and m["step"] == 1.0
    assert m["num_tokens"] == 12 + 14 + 16 + 18  # summed over the two mini-batches
    assert m["mismatch/rollout_is_mean"] > 0  # TIS (rl.tis) computed once, on the whole batch
