"""Clipped policy losses, aggregation modes, KL/entropy terms and the autograd gradient on
hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms.policy_loss import (
    PolicyLossConfig,
    aggregate,
    kl_penalty,
    make_policy_loss_fn,
    policy_loss,
)
from megatron_rl.records.batch import ADVANTAGES, IS_WEIGHTS, OLD_LOGPROBS, TokenBatch
from megatron_rl.rewards.shaping import overlong_penalty

LN = math.log
# two rows, old log-probs 0, so the ratio is exp(logp):
#   row 0: ratios [1, 1.5, 0.5], A = [2, 1, 1], all masked in
#   row 1: ratios [0.5, 2, 1],   A = [-1, -1, 0], last token masked out
LOGP = [[0.0, LN(1.5), LN(0.5)], [LN(0.5), LN(2.0), 0.0]]
ADV = [[2.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0]]


PPO = {"clip_ratio_high": 0.2}  # the hand-computed cases clip symmetrically to [0.8, 1.2]


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
    out = _loss(PolicyLossConfig(loss_agg_mode=mode, **PPO))
    assert out.loss_sum.item() == pytest.approx(loss_sum)
    assert out.num_tokens.item() == count and out.num_tokens.dtype == torch.int
    # token means whatever the aggregation: 2 of 5 tokens clipped, reported / 5 = 0.4 (in
    # seq-mean-token-sum it read 2 / 2 rows = 1.0 before)
    assert out.token_metrics["pg_clipfrac"].item() == 2 and out.masked_tokens.item() == 5
    # ratios 1 + 1.5 + 0.5 + 0.5 + 2 = 5.5 over 5 tokens
    assert out.token_metrics["ratio"].item() == pytest.approx(5.5)
    # ppo_kl is verl's k1, old - logp: -ln(1 * 1.5 * 0.5 * 0.5 * 2) = -ln 0.75 = 0.28768 over
    # 5 tokens = 0.05754 (the k3 it was, e^-x + x - 1 per token, summed to 0.87899: 0.17580)
    assert out.token_metrics["ppo_kl"].item() == pytest.approx(-LN(0.75))
    assert out.metrics["pg_loss"].item() == pytest.approx(loss_sum)  # as the loss


def test_dapo_asymmetric_clip():
    # clip [0.8, 1.28]: row 0 token 1 becomes max(-1.5, -1.28) = -1.28; the rest as above
    # sum = -2 - 1.28 - 0.5 + 0.8 + 2 = -0.98
    out = _loss(PolicyLossConfig(clip_ratio_high=0.28, loss_agg_mode="token-mean"))
    assert out.loss_sum.item() == pytest.approx(-0.98)


def test_splits_give_the_same_global_mean():
    # micro-batches / DP ranks hold whole rows: summing their (sum, count) gives the full batch
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        cfg = PolicyLossConfig(loss_agg_mode=mode, **PPO)
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
    cfg = PolicyLossConfig(ratio_level="sequence", loss_agg_mode="token-mean", **PPO)
    out = policy_loss(lp, torch.zeros(2, 3), torch.tensor([[1.0, 1, 0], [-1, -1, -1]]),
                      torch.tensor([[1, 1, 0], [1, 1, 1]]), cfg)
    assert out.loss_sum.item() == pytest.approx(0.6)
    assert out.token_metrics["pg_clipfrac"].item() == 2
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
                      torch.ones(1, 3), PolicyLossConfig(**PPO))
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
    out = make_policy_loss_fn(PolicyLossConfig(**PPO))(lp, torch.zeros(1, 3), batch)
    assert out.loss_sum.item() == pytest.approx(-3.45)
    assert out.num_tokens.item() == 3


def test_config_defaults():
    # verl's defaults: dual clip c = 3, DAPO clip-higher 0.28
    cfg = PolicyLossConfig()
    assert (cfg.clip_ratio_c, cfg.clip_ratio_low, cfg.clip_ratio_high) == (3.0, 0.2, 0.28)


def test_config_validation():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        PolicyLossConfig(loss_agg_mode="seq-sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rl.loss.clip_ratio_low"):
        PolicyLossConfig(clip_ratio_low=1.5)
    with pytest.raises(ValueError, match="rl.loss.clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=0.5)  # must bound above the clipped ratio


def test_gspo_token_keeps_per_token_advantages():
    # one sequence, advantages [1, -1], ratio 1 (logp = old), seq-mean-token-mean over 1 row:
    # loss = (-1 * r + 1 * r) / 2 with r_t = sg[s] * pi_t / sg[pi_t]; d loss / d logp_t =
    # -A_t * s / 2 = [-0.5, 0.5] (verl's). Through the sequence's mean log-ratio (before) the
    # two credits cancelled: [0, 0].
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    out = policy_loss(lp, lp.detach().clone(), torch.tensor([[1.0, -1.0]], dtype=torch.float64),
                      torch.ones(1, 2), PolicyLossConfig(ratio_level="sequence"))
    assert out.num_tokens.item() == 1  # seq-mean-token-mean, implied by ratio_level=sequence
    (out.loss_sum / out.num_tokens).backward()
    assert lp.grad[0].tolist() == pytest.approx([-0.5, 0.5])
    assert out.token_metrics["ratio"].item() == pytest.approx(2.0)  # r = 1 on both tokens


def test_gspo_value_is_the_sequence_ratio():
    # log-ratios [0.1, 0.3] -> every token's ratio is e^0.2 (clip 0.28 does not bind), A = 1:
    # seq-mean-token-mean loss = -e^0.2
    lp = torch.tensor([[0.1, 0.3]], dtype=torch.float64)
    out = policy_loss(lp, torch.zeros_like(lp), torch.ones(1, 2, dtype=torch.float64),
                      torch.ones(1, 2), PolicyLossConfig(ratio_level="sequence"))
    assert out.loss_sum.item() == pytest.approx(-math.exp(0.2))
    assert out.token_metrics["ratio"].item() == pytest.approx(2 * math.exp(0.2))


def test_ratio_level_sequence_implies_seq_mean_token_mean_unless_set():
    assert PolicyLossConfig(ratio_level="sequence").aggregation == "seq-mean-token-mean"
    assert PolicyLossConfig().aggregation == "token-mean"
    explicit = PolicyLossConfig(ratio_level="sequence", loss_agg_mode="token-mean")
    assert explicit.aggregation == "token-mean"


@pytest.mark.parametrize("clip_c,loss,lower", [(3.0, 3.0, 1.0), (0.0, 5.0, None)])
def test_dual_clip(clip_c, loss, lower):
    # A = -1, ratio 5: pg = max(-A r, -A clip(r)) = max(5, 1.28) = 5; dual clip: min(5, -A c) = 3
    lp = torch.tensor([[LN(5.0)]], dtype=torch.float64, requires_grad=True)
    out = policy_loss(lp, torch.zeros_like(lp), torch.tensor([[-1.0]], dtype=torch.float64),
                      torch.ones(1, 1), PolicyLossConfig(clip_ratio_c=clip_c))
    assert out.loss_sum.item() == pytest.approx(loss)
    assert out.token_metrics.get("pg_clipfrac_lower", torch.tensor(-1.0)).item() == \
        (lower if lower is not None else -1.0)
    out.loss_sum.backward()
    # the dual-clipped loss is a constant -A c: no gradient; without it d(5)/d logp = 5
    assert lp.grad.item() == pytest.approx(0.0 if clip_c else 5.0)
    # a positive advantage is never dual-clipped: A = 1, ratio 5 -> max(-5, -1.28) = -1.28
    pos = policy_loss(lp.detach(), torch.zeros(1, 1, dtype=torch.float64),
                      torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1),
                      PolicyLossConfig(clip_ratio_c=clip_c))
    assert pos.loss_sum.item() == pytest.approx(-1.28)


def test_overlong_penalty():
    # max 100, cache 20: free up to 80, then (80 - L) / 20, -1 beyond 100
    assert [overlong_penalty(n, 100, 20) for n in (50, 80, 90, 100, 101)] == \
        [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(95, 100, 20, factor=0.5) == pytest.approx(-0.375)  # 0.5 * -15/20
    with pytest.raises(ValueError):
        overlong_penalty(10, 100, 0)
