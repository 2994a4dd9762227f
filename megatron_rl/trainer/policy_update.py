"""One RL update of the Megatron policy on a step's rollout batch (collective: every trainer
rank), as verl and slime run it: the batch is split into `mini_batches` PPO mini-batches, one
optimizer step each, for `epochs` passes.

The "old" log-probs are the trainer's own, computed once before the first optimizer step by the
weights that take it, so the first mini-batch sees ratio 1 and every later one sees how far the
earlier steps moved the policy: that is where the clip binds. The engine's log-probs enter only
through truncated importance sampling, which corrects for the trainer / engine mismatch
(kernels, stale weight versions). Token-budget micro-batches apply inside each mini-batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_rl.algorithms.policy_loss import make_policy_loss_fn
from megatron_rl.algorithms.tis import rollout_is_weights
from megatron_rl.config.schema import PolicyLossConfig, TISConfig
from megatron_rl.records.batch import (
    IS_WEIGHTS,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    ROLLOUT_LOGPROBS,
    TokenBatch,
)

# merged over a step's optimizer steps by sum / by max instead of the mean
SUMMED, MAXED = ("num_tokens",), ("skipped",)


def split_mini_batches(batch: TokenBatch, k: int, rows_multiple: int = 1) -> list[TokenBatch]:
    """The batch's trained rows in `k` contiguous parts of near-equal size (rows stay whole and
    in order, so a GRPO group mostly stays in one part), each padded with fully masked rows to
    a multiple of `rows_multiple` (DP ranks x micro-batch size). Fewer parts when there are
    fewer trained rows than `k`."""
    trained = batch.loss_mask.any(-1).nonzero().flatten()
    k = max(1, min(k, len(trained)))
    if k == 1:
        return [batch]
    parts = []
    for chunk in torch.tensor_split(trained, k):
        rows = math.ceil(len(chunk) / rows_multiple) * rows_multiple
        filler = chunk[:1].expand(rows - len(chunk))
        part = batch.select(torch.cat([chunk, filler]))
        part.loss_mask[len(chunk):] = 0
        parts.append(part)
    return parts


def policy_update_steps(actor: Any, batch: TokenBatch, loss: PolicyLossConfig,
                        tis: TISConfig | None = None, reference: Any = None, *,
                        mini_batches: int = 1, epochs: int = 1, rows_multiple: int = 1
                        ) -> tuple[list[dict[str, float]], dict[str, float]]:
    """The optimizer steps of one run step: (metrics of each optimizer step, the step's own
    metrics: mismatch, timing, LR and step count). Old log-probs, TIS weights (`tis` with a
    threshold > 0) and reference log-probs (`loss.kl_coef`, from `reference`, a
    `trainer.reference.ReferencePolicy`) are computed once, on the whole batch."""
    start = actor.forward_backward_seconds
    old, _ = actor.compute_logprobs(batch)
    batch.extras[OLD_LOGPROBS] = old.detach()
    metrics: dict[str, float] = {}
    if loss.kl_coef:
        if reference is None:
            raise ValueError("rl.loss.kl_coef > 0 needs a reference policy")
        batch.extras[REF_LOGPROBS] = reference.logprobs(actor, batch)
    if tis is not None and tis.threshold > 0:
        result = rollout_is_weights(old, batch.extras[ROLLOUT_LOGPROBS], batch.loss_mask, tis)
        batch.extras[IS_WEIGHTS] = result.weights
        metrics.update(result.metrics)
    loss_fn = make_policy_loss_fn(loss)
    parts = split_mini_batches(batch, mini_batches, rows_multiple)
    steps = [actor.train_step(part, loss_fn, end_step=False)
             for _ in range(epochs) for part in parts]
    metrics.update(actor.end_step())
    metrics["time/forward_backward"] = actor.forward_backward_seconds - start
    return steps, metrics


def skipped_step(actor: Any) -> dict[str, float]:
    """A run step that trains nothing (no trained token, or no group left after dynamic
    sampling) still counts, as a skipped optimizer step does: checkpoints and HF exports are
    named by the run's step."""
    actor.step += 1
    return {"skipped": 1.0, "loss": 0.0, "grad_norm": 0.0, "num_tokens": 0.0,
            "step": float(actor.step)}


def policy_update(actor: Any, batch: TokenBatch, loss: PolicyLossConfig,
                  tis: TISConfig | None = None, reference: Any = None, *,
                  mini_batches: int = 1, epochs: int = 1, rows_multiple: int = 1
                  ) -> dict[str, float]:
    """One run step's update; its metrics are the optimizer steps' means (token counts summed,
    `skipped` if any was), plus `optimizer_steps`.

    A batch with no trained token (every trajectory excluded, e.g. all environment failures)
    takes no step: its only gradient would be the MoE auxiliary loss, scaled by a token count
    of zero."""
    if not batch.loss_mask.any():
        return skipped_step(actor)
    steps, metrics = policy_update_steps(actor, batch, loss, tis, reference,
                                         mini_batches=mini_batches, epochs=epochs,
                                         rows_multiple=rows_multiple)
    for key in dict.fromkeys(k for s in steps for k in s):
        values = [s[key] for s in steps if key in s]
        merge = sum if key in SUMMED else max if key in MAXED else _mean
        metrics[key] = float(merge(values))
    metrics["optimizer_steps"] = float(len(steps))
    return metrics


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
