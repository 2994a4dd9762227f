"""Job bodies for RL-update tests (run inside the worker pools)."""

from __future__ import annotations

import torch

from megatron_rl.algorithms.policy_loss import PolicyLossConfig, make_policy_loss_fn
from megatron_rl.algorithms.rdpo import token_advantages
from megatron_rl.algorithms.reward_managers import turn_advantages
from megatron_rl.algorithms.tis import TISConfig, rollout_is_weights
from megatron_rl.checkpoint.training_checkpoint import load_checkpoint
from megatron_rl.records.batch import IS_WEIGHTS, OLD_LOGPROBS, ROLLOUT_LOGPROBS
from megatron_rl.records.trajectory import Trajectory, Turn
from megatron_rl.trainer.batching import build_batch
from megatron_rl.trainer.policy_update import policy_update, policy_update_steps
from tests import dist_cases

SEQ = 32  # model.seq_length: divisible by TP2 (sequence parallel)


def group_of_rollouts(rewards=(1.0, 0.0, 0.0, 1.0), seed: int = 5) -> list[Trajectory]:
    """One GRPO group: 4 single-turn rollouts of one prompt with made-up engine log-probs."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 512, (8,), generator=g).tolist()
    out = []
    for i, r in enumerate(rewards):
        ids = torch.randint(0, 512, (12 + 2 * i,), generator=g).tolist()
        logprobs = (-6.0 + 0.1 * torch.randn(len(ids), generator=g)).tolist()
        turn = Turn("agent", prompt, ids, logprobs, [0] * len(ids))
        out.append(Trajectory(f"u{i}", "g0", "q", "a", [turn], rewards={"outcome": r}))
    return out


def rollout_batch(rewards=(1.0, 0.0, 0.0, 1.0)):
    trajs = group_of_rollouts(rewards)
    adv, _ = turn_advantages("grpo", trajs)
    seqs = [t.sequences()[0] for t in trajs]
    per_token = [token_advantages([s], a)[0] for s, a in zip(seqs, adv, strict=True)]
    return build_batch(seqs, per_token, seq_length=SEQ, pad_id=0, rows_multiple=2), adv


def loaded_actor(overrides: list[str], init: str):
    """A one-step-batch actor with the saved initial weights (`dist_cases.save_initial`)."""
    actor = dist_cases.make_actor([f"model.seq_length={SEQ}", "train.global_batch_size=4",
                                   *overrides])
    load_checkpoint(actor, init, optimizer=False, rng=False)
    return actor


def update(overrides: list[str], init: str) -> dict:
    """One policy update from the shared initial weights; the metrics and, for the sign
    check, each row's mean log-prob change on its trained tokens."""
    actor = loaded_actor(overrides, init)
    batch, _ = rollout_batch()
    before, _ = actor.compute_logprobs(batch)
    metrics = policy_update(actor, batch, PolicyLossConfig(), TISConfig())
    after, _ = actor.compute_logprobs(batch)
    m = batch.loss_mask
    delta = ((after - before) * m).sum(1) / m.sum(1).clamp(min=1)
    return {**metrics, "row_delta": delta.tolist()}


def zero_advantage_drift(overrides: list[str], init: str) -> dict:
    """A GRPO update on a group whose rewards all agree (every advantage 0): the largest
    change of any weight, the router's included."""
    actor = loaded_actor(overrides, init)
    batch, _ = rollout_batch(rewards=(1.0, 1.0, 1.0, 1.0))
    module = actor.model[0].module
    before = {k: v.detach().clone() for k, v in module.state_dict().items()
              if isinstance(v, torch.Tensor) and v.is_floating_point()}
    metrics = policy_update(actor, batch, PolicyLossConfig(), TISConfig())
    after = module.state_dict()
    moved = {k: float((after[k] - v).abs().max()) for k, v in before.items()}
    return {"loss": metrics["loss"], "max_change": max(moved.values()),
            "router_change": max(v for k, v in moved.items() if "router" in k)}


def one_step_as_before(overrides: list[str], init: str) -> dict:
    """K = 1 (the on-policy shortcut: no separate forward pass) against the update as it was
    before: old log-probs and TIS weights from a forward pass, then one `train_step` of the
    loss. Both from the same initial weights, with token-level TIS."""
    loss, tis = PolicyLossConfig(), TISConfig()
    out = {}
    for how in ("policy_update", "train_step"):
        actor = loaded_actor(overrides, init)
        batch, _ = rollout_batch()
        if how == "policy_update":
            forward = actor.compute_logprobs
            calls = []
            actor.compute_logprobs = lambda b, f=forward, c=calls, **kw: c.append(1) or f(b, **kw)
            m = policy_update(actor, batch, loss, tis, mini_batches=1, epochs=1,
                              rows_multiple=2)
            actor.compute_logprobs = forward
            m["forward_passes"] = len(calls)
        else:
            old, _ = actor.compute_logprobs(batch)
            batch.extras[OLD_LOGPROBS] = old
            result = rollout_is_weights(old, batch.extras[ROLLOUT_LOGPROBS], batch.loss_mask,
                                        tis)
            batch.extras[IS_WEIGHTS] = result.weights
            m = {**actor.train_step(batch, make_policy_loss_fn(loss)), **result.metrics}
        after, _ = actor.compute_logprobs(batch)
        out[how] = {**{k: v for k, v in m.items() if not k.startswith("time/")},
                    "after": after.tolist()}
    return out


def trained_only_logprobs(overrides: list[str], init: str) -> dict:
    """`compute_logprobs` over every position and over the trained targets only."""
    actor = loaded_actor(overrides, init)
    batch, _ = rollout_batch()
    full, _ = actor.compute_logprobs(batch)
    trained, _ = actor.compute_logprobs(batch, trained_only=True)
    return {"full": full, "trained": trained, "mask": batch.loss_mask.bool()}


def mini_batch_steps(overrides: list[str], init: str, k: int, epochs: int = 1,
                     loss_agg_mode: str | None = None) -> dict:
    """The optimizer steps of one run step split into `k` PPO mini-batches."""
    actor = loaded_actor(overrides, init)
    batch, _ = rollout_batch()
    loss = PolicyLossConfig(clip_ratio_high=0.2, loss_agg_mode=loss_agg_mode)
    steps, metrics = policy_update_steps(actor, batch, loss, None, mini_batches=k,
                                         epochs=epochs, rows_multiple=2)
    return {"steps": steps, "metrics": metrics, "optimizer_steps": actor.optimizer_steps}


def worker_update(overrides: list[str], init: str) -> dict:
    """One run step's update as the driver calls it: `TrainerWorker.update` with the recipe's
    rl.* (mini-batches, TIS) and train.* (micro-batching) settings."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.trainer.worker import TrainerWorker

    cfg = load_config(None, [*dist_cases.BASE, f"model.seq_length={SEQ}",
                             "train.global_batch_size=4", *overrides])
    worker = TrainerWorker(cfg, initial=init)
    batch, _ = rollout_batch()
    metrics = worker.update(batch, cfg.rl.loss.entropy_coef)
    return {"metrics": metrics, "optimizer_steps": worker.actor.optimizer_steps,
            "step": worker.actor.step}
