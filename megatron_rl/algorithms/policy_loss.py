"""Clipped policy-gradient losses as verl computes them (PPO/GRPO with dual clip, DAPO's
asymmetric clip, GSPO in its per-token form) with optional KL to a reference policy and an
entropy bonus, returned as a sum plus a normaliser count so they fit the loss protocol
(`records.batch.LossFn`): megatron divides the global sum by the global count, over all
micro-batches and DP ranks.

Sign convention: the returned loss is minimised; advantages > 0 push a token's log-prob up.
All per-token inputs are [rows, seq] aligned with `TokenBatch.labels`; a row is one training
sequence (packed rows are unpacked before the loss), and only `loss_mask` positions count.
"""

from __future__ import annotations

from typing import Literal

import torch

from megatron_rl.config.schema import AGG_MODES, PolicyLossConfig
from megatron_rl.records.batch import (
    ADVANTAGES,
    IS_WEIGHTS,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    LossFn,
    LossOutput,
    TokenBatch,
)

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]

LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: keeps a stray log-ratio from overflowing to inf
SEQ_LOG_RATIO_MAX = 10.0  # GSPO's cap on the sequence log-ratio (verl's)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: AggMode
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) whose global ratio is the `mode` mean; each row is one sequence.

    token-mean:          sum of all masked tokens;          count = masked tokens
    seq-mean-token-sum:  sum over rows of the row's sum;    count = rows with a masked token
    seq-mean-token-mean: sum over rows of the row's mean;   count = rows with a masked token
    Rows are never split across micro-batches or DP ranks, so any split sums to the same
    (sum, count) and megatron's global sum / global count is the same mean.
    """
    m = mask.bool()
    masked = torch.where(m, values, torch.zeros_like(values))  # where, not *: 0 * inf = nan
    if mode == "token-mean":
        return masked.sum(), m.sum()
    n = m.sum(-1)
    row = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        row = row / n.clamp(min=1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"loss_agg_mode={mode!r}: one of {', '.join(AGG_MODES)}")
    return row.sum(), (n > 0).sum()


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
               estimator: Literal["k1", "k3"]) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1 / k3)."""
    log_ratio = (logprobs - ref_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if estimator == "k1":
        return log_ratio
    return torch.exp(-log_ratio) + log_ratio - 1  # k3 = r - log r - 1, r = ref / pi; >= 0


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, cfg: PolicyLossConfig, *,
                ref_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                is_weights: torch.Tensor | None = None) -> LossOutput:
    """Per-token clipped surrogate, aggregated by `cfg.aggregation` into (sum, count); the
    numbers of verl's `compute_policy_loss_vanilla` (token ratio) and
    `compute_policy_loss_gspo` (sequence ratio).

    token ratio:     r_t = exp(logp_t - old_t)
    sequence ratio:  r_t = exp(sg[mean_row(logp - old)] + logp_t - sg[logp_t])  (GSPO-token):
                     the sequence's ratio in value, each token's own gradient, so per-token
                     advantages (RDPO's, per turn) keep their credit
    pg_t = max(-A_t r_t, -A_t clip(r_t, 1 - low, 1 + high))
    dual clip (token ratio, c = clip_ratio_c > 1): pg_t = min(pg_t, -A_t c) where A_t < 0
    pg_t *= w_t (TIS weights, detached);  loss_t = pg_t + kl_coef KL_t - entropy_coef H_t
    `pg_loss`, `kl` and `entropy` are aggregated as the loss is; `pg_clipfrac`,
    `pg_clipfrac_lower`, `ratio` and `ppo_kl` are token means whatever the aggregation.
    """
    mask = loss_mask.bool()
    zeros = torch.zeros_like(logprobs)
    log_ratio = torch.where(mask, logprobs - old_logprobs, zeros)
    if cfg.ratio_level == "sequence":
        seq = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = (seq.detach() + logprobs - logprobs.detach()).clamp(max=SEQ_LOG_RATIO_MAX)
    else:
        log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.where(mask, torch.exp(log_ratio), zeros)
    adv = torch.where(mask, advantages.to(ratio.dtype), zeros)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    token_metrics = {"pg_clipfrac": (pg_clipped > pg_unclipped).to(pg.dtype),
                     "ratio": ratio.detach(),
                     # verl's: k1 of the old (rollout-time) policy against this one,
                     # mean(old - logp), so it can be negative
                     "ppo_kl": kl_penalty(old_logprobs, logprobs.detach(), "k1")}
    if cfg.clip_ratio_c and cfg.ratio_level == "token":
        bound = -adv * cfg.clip_ratio_c
        negative = adv < 0
        token_metrics["pg_clipfrac_lower"] = (negative & (pg > bound)).to(pg.dtype)
        pg = torch.where(negative, torch.minimum(pg, bound), pg)
    if is_weights is not None:
        pg = pg * is_weights.detach()
    loss = pg
    metrics = {"pg_loss": pg.detach()}
    if cfg.kl_coef:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = kl.detach()
    if entropy is not None:
        metrics["entropy"] = entropy.detach()
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy
    elif cfg.entropy_coef:
        raise ValueError("entropy_coef > 0 needs the per-token entropy")
    mode = cfg.aggregation
    loss_sum, count = aggregate(loss, mask, mode)
    return LossOutput(
        loss_sum, count.to(torch.int),
        metrics={k: aggregate(v, mask, mode)[0] for k, v in metrics.items()},
        token_metrics={k: aggregate(v, mask, "token-mean")[0] for k, v in token_metrics.items()},
        masked_tokens=mask.sum().to(torch.int))


def make_policy_loss_fn(cfg: PolicyLossConfig) -> LossFn:
    """A `LossFn` for `MegatronActor.train_step` reading old log-probs, advantages and, when
    present, reference log-probs and TIS weights from `batch.extras` (keys above)."""
    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor, batch: TokenBatch) -> LossOutput:
        x = batch.extras
        return policy_loss(logprobs, x[OLD_LOGPROBS], x[ADVANTAGES], batch.loss_mask, cfg,
                           ref_logprobs=x.get(REF_LOGPROBS), entropy=entropy,
                           is_weights=x.get(IS_WEIGHTS))
    return loss_fn
