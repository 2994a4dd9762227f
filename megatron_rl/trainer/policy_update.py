"""One RL update of the Megatron policy on a rollout batch (collective: every trainer rank).

The "old" log-probs are the trainer's own, taken before the step (ratio 1 at the first update
of a batch); the engine's log-probs enter only through truncated importance sampling, which
corrects for the trainer / engine mismatch (kernels, stale weight versions).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.algorithms.policy_loss import (
    IS_WEIGHTS,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    PolicyLossConfig,
    make_policy_loss_fn,
)
from megatron_rl.algorithms.tis import TISConfig, rollout_is_weights
from megatron_rl.rollout.batching import ROLLOUT_LOGPROBS
from megatron_rl.trainer.batch import TokenBatch


def policy_update(actor: Any, batch: TokenBatch, loss: PolicyLossConfig,
                  tis: TISConfig | None = None, reference: Any = None) -> dict[str, float]:
    """Old log-probs, TIS weights (when `tis`), reference log-probs (when `loss.kl_coef`,
    from `reference`, a `trainer.reference.ReferencePolicy`), then one optimizer step of the
    policy loss.
    Returns the step's metrics (loss, grad norm, the loss's own metrics, mismatch metrics).

    A batch with no trained token (every trajectory excluded, e.g. all environment failures)
    takes no step: its only gradient would be the MoE auxiliary loss, scaled by a token count
    of zero."""
    start = actor.forward_backward_seconds
    if not batch.loss_mask.any():
        actor.step += 1  # still a step of the run (as a skipped optimizer step is)
        return {"skipped": 1.0, "loss": 0.0, "grad_norm": 0.0, "num_tokens": 0.0,
                "step": float(actor.step)}
    old, _ = actor.compute_logprobs(batch)
    batch.extras[OLD_LOGPROBS] = old.detach()
    metrics: dict[str, float] = {}
    if loss.kl_coef:
        if reference is None:
            raise ValueError("kl_coef > 0 needs a reference policy")
        batch.extras[REF_LOGPROBS] = reference.logprobs(actor, batch)
    if tis is not None:
        result = rollout_is_weights(old, batch.extras[ROLLOUT_LOGPROBS], batch.loss_mask, tis)
        batch.extras[IS_WEIGHTS] = result.weights
        metrics.update(result.metrics)
    metrics.update(actor.train_step(batch, make_policy_loss_fn(loss)))
    metrics["time/forward_backward"] = actor.forward_backward_seconds - start
    return metrics
