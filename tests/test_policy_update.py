"""A GRPO update of the Megatron policy on a rollout batch: the same numbers at 1 and 2 ranks,
and it moves probability the way the advantages say."""

from __future__ import annotations

import pytest

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
    assert adv.advantages == pytest.approx([0.866, -0.866, -0.866, 0.866], abs=1e-3)
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
