"""One RL update of the Megatron policy on a step's rollout batch (collective: every trainer
rank), as verl and slime run it: the batch is split into `mini_batches` PPO mini-batches, one
optimizer step each, for `epochs` passes.

The "old" log-probs are the trainer's own, computed once before the first optimizer step by the
weights that take it, so the first mini-batch sees ratio 1 and every later one sees how far the
earlier steps moved the policy: that is where the clip binds. The engine's log-probs enter only
through truncated importance sampling, which corrects for the trainer / engine mismatch
(kernels, stale weight versions). Token-budget micro-batches apply inside each mini-batch.

With one mini-batch and one epoch the old log-probs are the training pass's own, detached
(verl's on-policy case): the ratio is 1 either way, so the separate forward pass is skipped
and token-level TIS weights come from the same log-probs (`on_policy_loss_fn`).
"""

from __future__ import annotations

import copy
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
    LossFn,
    LossOutput,
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
    tis = tis if tis is not None and tis.threshold > 0 else None
    metrics: dict[str, float] = {}
    if loss.kl_coef:
        if reference is None:
            raise ValueError("rl.loss.kl_coef > 0 needs a reference policy")
        batch.extras[REF_LOGPROBS] = reference.logprobs(actor, batch)
    loss_fn = make_policy_loss_fn(loss)
    if mini_batches == 1 and epochs == 1 and one_pass_tis(tis):
        steps = [actor.train_step(batch, on_policy_loss_fn(loss_fn, tis), end_step=False)]
        metrics.update(pop_tis_metrics(steps[0]) if tis else {})
    else:
        old, _ = actor.compute_logprobs(batch, trained_only=True)
        batch.extras[OLD_LOGPROBS] = old.detach()
        if tis:
            result = rollout_is_weights(old, batch.extras[ROLLOUT_LOGPROBS], batch.loss_mask,
                                        tis)
            batch.extras[IS_WEIGHTS] = result.weights
            metrics.update(result.metrics)
        parts = split_mini_batches(batch, mini_batches, rows_multiple)
        steps = [actor.train_step(part, loss_fn, end_step=False)
                 for _ in range(epochs) for part in parts]
    metrics.update(actor.end_step())
    metrics["time/forward_backward"] = actor.forward_backward_seconds - start
    return steps, metrics


def one_pass_tis(tis: TISConfig | None) -> bool:
    """Whether TIS can be computed micro-batch by micro-batch in the training pass with the
    same numbers as on the whole batch: per-token weights, and every metric a token mean."""
    return tis is None or (tis.level == "token" and tis.veto_threshold is None)


_TIS_SUMS = "tis/"  # token means the training pass reports, turned into `rollout_is_weights`'s


def on_policy_loss_fn(loss_fn: LossFn, tis: TISConfig | None) -> LossFn:
    """`loss_fn` with the micro-batch's own detached log-probs as the old ones and, with `tis`,
    its truncated importance weights against the engine's log-probs."""
    def fn(logprobs: torch.Tensor, entropy: torch.Tensor, mb: TokenBatch) -> LossOutput:
        view = copy.copy(mb)
        view.extras = {**mb.extras, OLD_LOGPROBS: logprobs.detach()}
        if tis is None:
            return loss_fn(logprobs, entropy, view)
        result = rollout_is_weights(logprobs, mb.extras[ROLLOUT_LOGPROBS], mb.loss_mask, tis,
                                    with_metrics=False)
        view.extras[IS_WEIGHTS] = result.weights
        out = loss_fn(logprobs, entropy, view)
        m, w = mb.loss_mask.bool(), result.weights.double()
        per_token = {"ratio": result.token_ratio, "abs_diff": result.log_ratio.abs(), "w": w,
                     "w2": w * w, "over": (result.token_ratio > tis.threshold).double()}
        out.token_metrics.update({_TIS_SUMS + k: torch.where(m, v, 0.0).sum()
                                  for k, v in per_token.items()})
        if out.masked_tokens is None:
            out.masked_tokens = m.sum().to(torch.int)
        return out
    return fn


def pop_tis_metrics(step: dict[str, float]) -> dict[str, float]:
    """`rollout_is_weights`'s metrics from the token means `on_policy_loss_fn` reported."""
    t = {k.removeprefix(_TIS_SUMS): step.pop(k) for k in list(step) if k.startswith(_TIS_SUMS)}
    return {"mismatch/rollout_is_mean": t["ratio"],
            "mismatch/rollout_is_eff_sample_size": t["w"] ** 2 / t["w2"] if t["w2"] else 0.0,
            "mismatch/rollout_is_veto_fraction": 0.0,
            "mismatch/rollout_is_clipped_fraction": t["over"],
            "mismatch/train_rollout_logprob_abs_diff": t["abs_diff"]}


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
