"""Truncated importance sampling (TIS) for the trainer / rollout-engine mismatch.

The engine samples with its own kernels (and maybe older weights), so its log-probs differ
from the trainer's for the same tokens. The policy loss is reweighted by
rho = pi_train / pi_rollout, per token or per sequence (the product of its token ratios):

- `truncate`: w = min(rho, threshold)                   (TIS; LiteResearcher: token, 2.0)
- `mask`:     w = rho if rho <= threshold else 0        (drop the unit from the gradient)
- `veto_threshold` (optional): a sequence with any token ratio below it gets w = 0 throughout
  (a catastrophic token, e.g. sampled where the trainer gives it almost no mass).

Weights are 0 at masked positions and are used detached (`policy_loss(is_weights=...)`). A
zero weight removes the token's gradient but it still counts in the loss normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.algorithms.policy_loss import LOG_RATIO_LIMIT
from megatron_rl.config.schema import TISConfig


@dataclass
class TISResult:
    weights: torch.Tensor        # [rows, seq], 0 where masked
    metrics: dict[str, float]
    log_ratio: torch.Tensor      # [rows, seq] float64 per token, 0 where masked
    token_ratio: torch.Tensor    # [rows, seq] float64 per token


def rollout_is_weights(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                       loss_mask: torch.Tensor, cfg: TISConfig, *, with_metrics: bool = True
                       ) -> TISResult:
    """Importance weights and mismatch metrics over the masked tokens of a batch.

    Metrics (units are tokens at token level, sequences with a masked token at sequence level):
    - `mismatch/rollout_is_mean`: mean raw ratio rho, before truncation or masking
    - `mismatch/rollout_is_eff_sample_size`: (sum w)^2 / (N sum w^2) of the final weights, in
      [0, 1]; 1 when all weights are equal, 0 when all are 0
    - `mismatch/rollout_is_veto_fraction`: vetoed sequences / sequences
    - `mismatch/rollout_is_clipped_fraction`: units with rho > threshold
    - `mismatch/train_rollout_logprob_abs_diff`: mean |log pi_train - log pi_rollout| per token

    `with_metrics=False` leaves them out (a caller that sums the per-token parts itself).
    """
    if cfg.threshold <= 0:
        raise ValueError(f"rl.tis.threshold={cfg.threshold}: TIS is off (threshold 0)")
    m = loss_mask.bool()
    zeros = torch.zeros_like(train_logprobs, dtype=torch.float64)
    diff = torch.where(m, (train_logprobs.detach() - rollout_logprobs).double(), zeros)
    token_ratio = torch.exp(diff.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    rows = m.any(-1)
    if cfg.level == "token":
        ratio, valid = token_ratio, m
    else:
        ratio, valid = torch.exp(diff.sum(-1).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)), rows
    over = ratio > cfg.threshold
    if cfg.mode == "truncate":
        w = ratio.clamp(max=cfg.threshold)
    else:
        w = torch.where(over, torch.zeros_like(ratio), ratio)
    vetoed = torch.zeros_like(rows)
    if cfg.veto_threshold is not None:
        vetoed = (m & (token_ratio < cfg.veto_threshold)).any(-1)
        w = w * ~(vetoed.unsqueeze(-1) if cfg.level == "token" else vetoed)
    if cfg.level == "sequence":
        w = w.unsqueeze(-1).expand_as(diff)
    weights = torch.where(m, w, zeros)
    if not with_metrics:
        return TISResult(weights.to(train_logprobs.dtype), {}, diff, token_ratio)

    def mean(x: torch.Tensor, where: torch.Tensor) -> float:
        n = int(where.sum())
        return float(x[where].sum() / n) if n else 0.0

    final = w if cfg.level == "token" else w[:, 0]
    sq = float((final[valid] ** 2).sum())
    ess = float(final[valid].sum()) ** 2 / (int(valid.sum()) * sq) if sq > 0 else 0.0
    metrics = {"mismatch/rollout_is_mean": mean(ratio, valid),
               "mismatch/rollout_is_eff_sample_size": ess,
               "mismatch/rollout_is_veto_fraction": mean(vetoed.double(), rows),
               "mismatch/rollout_is_clipped_fraction": mean(over.double(), valid),
               "mismatch/train_rollout_logprob_abs_diff": mean(diff.abs(), m)}
    return TISResult(weights.to(train_logprobs.dtype), metrics, diff, token_ratio)
