"""Clipped policy losses, aggregation modes, KL/entropy terms and the autograd gradient on
hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms.policy_loss import (
    ADVANTAGES,
    IS_WEIGHTS,
    OLD_LOGPROBS,
    PolicyLossConfig,
    aggregate,
    kl_penalty,
    make_policy_loss_fn,
    overlong_penalty,
    policy_loss,
)
from megatron_rl.trainer.batch import TokenBatch

LN = math.log
# two rows, old log-probs 0, so the ratio is exp(logp):
#   row 0: ratios [1, 1.5, 0.5], A = [2, 1, 1], all masked in
#   row 1: ratios [0.5, 2, 1],   A = [-1, -1, 0], last token masked out
LOGP = [[0.0, LN(1.5), LN(0.5)], [LN(0.5), LN(2.0), 0.0]]
ADV = [[2.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0]]


def _loss(cfg: PolicyLossConfig, logp=LOGP, adv=ADV, mask=MASK, **kw):
    lp = torch.tensor(logp, dtype=torch.float64)
    return policy_loss(lp, torch.zeros_like(lp), torch.tensor(adv, dtype=torch.float64),
                       torch.tensor(mask), cfg, **kw)


# per token with clip [0.8, 1.2], pg = max(-A r, -A clip(r)):
#   row 0: -2 * 1 = -2;  max(-1.5, -1.2) = -1.2 (clipped);  max(-0.5, -0.8) = -0.5  -> sum -3.7
#   row 1: max(0.5, 0.8) = 0.8 (clipped);  max(2, 1.2) = 2                          -> sum  2.8
@pytest.mark.parametrize("mode,loss_sum,count", [
    ("token-mean", -0.9, 5),                        # -3.7 + 2.8 over 5 tokens
    ("seq-mean-token-sum", -0.9, 2),                # row sums over 2 rows
    ("seq-mean-token-mean", -3.7 / 3 + 2.8 / 2, 2),  # -1.23333 + 1.4 = 0.16667 over 2 rows
])
def test_ppo_clip_and_aggregation_modes(mode, loss_sum, count):
    out = _loss(PolicyLossConfig(loss_agg_mode=mode))
    assert out.loss_sum.item() == pytest.approx(loss_sum)
    assert out.num_tokens.item() == count and out.num_tokens.dtype == torch.int
    if mode == "token-mean":
        assert out.metrics["pg_clipfrac"].item() == 2  # 2 of 5 tokens clipped (reported / 5)
        assert out.metrics["pg_loss"].item() == pytest.approx(-0.9)


def test_dapo_asymmetric_clip():
    # clip [0.8, 1.28]: row 0 token 1 becomes max(-1.5, -1.28) = -1.28; the rest as above
    # sum = -2 - 1.28 - 0.5 + 0.8 + 2 = -0.98
    out = _loss(PolicyLossConfig(clip_ratio_high=0.28))
    assert out.loss_sum.item() == pytest.approx(-0.98)


def test_splits_give_the_same_global_mean():
    # micro-batches / DP ranks hold whole rows: summing their (sum, count) gives the full batch
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        cfg = PolicyLossConfig(loss_agg_mode=mode)
        full = _loss(cfg)
        parts = [_loss(cfg, [LOGP[i]], [ADV[i]], [MASK[i]]) for i in range(2)]
        assert sum(p.loss_sum for p in parts).item() == pytest.approx(full.loss_sum.item())
        assert sum(p.num_tokens for p in parts).item() == full.num_tokens.item()


def test_empty_rows_do_not_count():
    vals = torch.tensor([[1.0, 2.0], [5.0, 5.0]])
    mask = torch.tensor([[1, 1], [0, 0]])   # row 1: padding only
    assert [t.item() for t in aggregate(vals, mask, "seq-mean-token-mean")] == [1.5, 1]
    # masked positions holding inf/nan must not leak (where, not multiply)
    vals[1] = math.inf
    assert aggregate(vals, mask, "token-mean")[0].item() == 3.0


def test_gspo_sequence_ratio_and_gradient():
    # row 0: log-ratios [0.1, 0.3], mean 0.2, r = e^0.2 = 1.2214 > 1.2, A = 1 -> clipped, -1.2 x 2
    # row 1: log-ratios [-0.1, 0, 0.1], mean 0, r = 1, A = -1 -> +1 x 3
    # token-mean: (-2.4 + 3) / 5 = 0.12
    lp = torch.tensor([[0.1, 0.3, 0.0], [-0.1, 0.0, 0.1]], requires_grad=True)
    cfg = PolicyLossConfig(ratio_level="sequence")
    out = policy_loss(lp, torch.zeros(2, 3), torch.tensor([[1.0, 1, 0], [-1, -1, -1]]),
                      torch.tensor([[1, 1, 0], [1, 1, 1]]), cfg)
    assert out.loss_sum.item() == pytest.approx(0.6)
    assert out.metrics["pg_clipfrac"].item() == 2
    (out.loss_sum / out.num_tokens).backward()
    # row 0 clipped: no gradient. Row 1: each of its 3 tokens carries -A r = r, and
    # dr/d logp_t = r / 3, so d(3 r)/d logp_t = r = 1, / 5 tokens = 0.2
    assert lp.grad.flatten().tolist() == pytest.approx([0, 0, 0] + [0.2] * 3)


def test_gradient_matches_hand_computation():
    # one row, token-mean over 3 tokens, clip [0.8, 1.2]; d(-A r)/d logp = -A r when unclipped:
    #   token 0: r = 1,   A = 2, unclipped -> -2 / 3
    #   token 1: r = 1.5, A = 1, clipped   -> 0
    #   token 2: r = 0.5, A = 1, unclipped (low clip only binds for A < 0) -> -0.5 / 3
    lp = torch.tensor([LOGP[0]], dtype=torch.float64, requires_grad=True)
    out = policy_loss(lp, torch.zeros_like(lp), torch.tensor([ADV[0]], dtype=torch.float64),
                      torch.ones(1, 3), PolicyLossConfig())
    (out.loss_sum / out.num_tokens).backward()
    assert lp.grad[0].tolist() == pytest.approx([-2 / 3, 0.0, -0.5 / 3])


def test_kl_estimators_and_entropy_bonus():
    # logp - ref = ln 2: k1 = 0.693147; k3 = e^{-ln 2} + ln 2 - 1 = 0.5 + 0.693147 - 1 = 0.193147
    lp, ref = torch.tensor([[LN(2.0)]]), torch.tensor([[0.0]])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.193147, abs=1e-6)
    # A = 0 (pg = 0): loss = 0.1 * 0.193147 - 0.01 * 1.5 = 0.0193147 - 0.015 = 0.0043147
    cfg = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01)
    out = policy_loss(lp, lp.clone(), torch.zeros(1, 1), torch.ones(1, 1), cfg,
                      ref_logprobs=ref, entropy=torch.tensor([[1.5]]))
    assert out.loss_sum.item() == pytest.approx(0.0043147, abs=1e-6)
    assert out.metrics["kl"].item() == pytest.approx(0.193147, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp, torch.zeros(1, 1), torch.ones(1, 1), cfg)


def test_loss_fn_reads_extras_and_tis_weights():
    # row 0 of the main case with TIS weights [1, 1, 0.5]: -2 - 1.2 - 0.25 = -3.45 over 3 tokens
    lp = torch.tensor([LOGP[0]])
    batch = TokenBatch(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long),
                       torch.ones(1, 3), extras={OLD_LOGPROBS: torch.zeros(1, 3),
                                                 ADVANTAGES: torch.tensor([ADV[0]]),
                                                 IS_WEIGHTS: torch.tensor([[1.0, 1.0, 0.5]])})
    out = make_policy_loss_fn(PolicyLossConfig())(lp, torch.zeros(1, 3), batch)
    assert out.loss_sum.item() == pytest.approx(-3.45)
    assert out.num_tokens.item() == 3


def test_config_validation():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        PolicyLossConfig(loss_agg_mode="seq-sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip range"):
        PolicyLossConfig(clip_ratio_low=1.5)


def test_overlong_penalty():
    # max 100, cache 20: free up to 80, then (80 - L) / 20, -1 beyond 100
    assert [overlong_penalty(n, 100, 20) for n in (50, 80, 90, 100, 101)] == \
        [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(95, 100, 20, factor=0.5) == pytest.approx(-0.375)  # 0.5 * -15/20
    with pytest.raises(ValueError):
        overlong_penalty(10, 100, 0)
