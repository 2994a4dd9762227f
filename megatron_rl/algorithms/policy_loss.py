"""Clipped policy-gradient losses (PPO/GRPO, DAPO asymmetric clip, GSPO) with optional KL to a
reference policy and an entropy bonus, returned as a sum plus a normaliser count so they fit
the trainer's loss protocol (`trainer/losses.py`): megatron divides the global sum by the
global count, over all micro-batches and DP ranks.

Sign convention: the returned loss is minimised; advantages > 0 push a token's log-prob up.
All per-token inputs are [rows, seq] aligned with `TokenBatch.labels`; a row is one training
sequence (no packing), and only `loss_mask` positions count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_rl.trainer.batch import TokenBatch
from megatron_rl.trainer.losses import LossFn, LossOutput

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

# the TokenBatch.extras keys `make_policy_loss_fn` reads
OLD_LOGPROBS, ADVANTAGES = "old_logprobs", "advantages"
REF_LOGPROBS, IS_WEIGHTS = "ref_logprobs", "rollout_is_weights"

LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: keeps a stray log-ratio from overflowing to inf


@dataclass
class PolicyLossConfig:
    ratio_level: Literal["token", "sequence"] = "token"  # "sequence" is GSPO
    clip_ratio_low: float = 0.2    # ratio clipped to [1 - low, 1 + high]; PPO/GRPO: equal
    clip_ratio_high: float = 0.2   # DAPO clip-higher: 0.28; GSPO: ~3e-4 / 4e-4
    loss_agg_mode: AggMode = "token-mean"
    kl_coef: float = 0.0           # KL(pi || ref) penalty; needs ref log-probs when > 0
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = 0.0      # entropy bonus (subtracted from the loss)

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in AGG_MODES:
            raise ValueError(f"loss_agg_mode={self.loss_agg_mode!r}: one of "
                             f"{', '.join(AGG_MODES)}")
        if self.ratio_level not in ("token", "sequence"):
            raise ValueError(f"ratio_level={self.ratio_level!r}: 'token' or 'sequence'")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator={self.kl_estimator!r}: 'k1' or 'k3'")
        if not (0 <= self.clip_ratio_low < 1 and self.clip_ratio_high >= 0):
            raise ValueError(f"clip range [1 - {self.clip_ratio_low}, 1 + "
                             f"{self.clip_ratio_high}] is not a range around 1")


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
    """Per-token clipped surrogate, aggregated by `cfg.loss_agg_mode` into (sum, count).

    token ratio:    r_t = exp(logp_t - old_t)
    sequence ratio: r_t = exp(mean over the row's masked tokens of (logp - old))   (GSPO)
    pg_t = max(-A_t r_t, -A_t clip(r_t, 1 - low, 1 + high)) * w_t   (w: TIS weights, detached)
    loss_t = pg_t + kl_coef * KL_t - entropy_coef * H_t
    Metrics are aggregated the same way, so the actor's division by the count yields means.
    """
    mask = loss_mask.bool()
    zeros = torch.zeros_like(logprobs)
    log_ratio = torch.where(mask, logprobs - old_logprobs, zeros)
    if cfg.ratio_level == "sequence":
        n = mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = (log_ratio.sum(-1, keepdim=True) / n).expand_as(log_ratio)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    adv = torch.where(mask, advantages.to(ratio.dtype), zeros)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    if is_weights is not None:
        pg = pg * is_weights.detach()
    loss = pg
    metrics = {"pg_loss": pg.detach(),
               "pg_clipfrac": (pg_clipped > pg_unclipped).to(pg.dtype),
               "ratio": ratio.detach(),
               # k3 of the policy against the rollout-time policy: how far this step moved
               "ppo_kl": kl_penalty(logprobs.detach(), old_logprobs, "k3")}
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
    loss_sum, count = aggregate(loss, mask, cfg.loss_agg_mode)
    reported = {k: aggregate(v, mask, cfg.loss_agg_mode)[0] for k, v in metrics.items()}
    return LossOutput(loss_sum, count.to(torch.int), reported)


def make_policy_loss_fn(cfg: PolicyLossConfig) -> LossFn:
    """A `LossFn` for `MegatronActor.train_step` reading old log-probs, advantages and, when
    present, reference log-probs and TIS weights from `batch.extras` (keys above)."""
    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor, batch: TokenBatch) -> LossOutput:
        x = batch.extras
        return policy_loss(logprobs, x[OLD_LOGPROBS], x[ADVANTAGES], batch.loss_mask, cfg,
                           ref_logprobs=x.get(REF_LOGPROBS), entropy=entropy,
                           is_weights=x.get(IS_WEIGHTS))
    return loss_fn


def overlong_penalty(response_length: int, max_length: int, cache_length: int,
                     factor: float = 1.0) -> float:
    """DAPO soft overlong punishment, added to the reward: 0 up to max_length - cache_length,
    then a linear ramp to -factor at max_length, and -factor beyond it."""
    if not 0 < cache_length <= max_length:
        raise ValueError(f"cache_length={cache_length} must be in (0, max_length={max_length}]")
    expected = max_length - cache_length
    if response_length <= expected:
        return 0.0
    if response_length <= max_length:
        return factor * (expected - response_length) / cache_length
    return -factor
