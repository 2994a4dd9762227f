"""Job bodies for MoE routing-replay tests (run inside the worker pools)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_rl.checkpoint.training_checkpoint import load_checkpoint
from megatron_rl.records.batch import ROUTED_EXPERTS, TokenBatch
from megatron_rl.trainer.losses import lm_loss
from tests import dist_cases

SEQ = 32       # model.seq_length: divisible by TP2 (sequence parallel)
E2E_SEQ = 96   # room for an agent's prompt and three short engine calls
REPLAY = ["rl.routing_replay=true", f"model.seq_length={SEQ}", "train.global_batch_size=4",
          "train.micro_batch_size=2"]  # b=2 per micro-batch: megatron's [s, b] order matters


def capture(actor: Any, fn: Callable[[], Any], seq: int = SEQ) -> tuple[Any, torch.Tensor]:
    """fn()'s result and the expert ids every router used on this rank, [rows, seq, layers,
    top_k] (a forward-only pass at one rank, one micro-batch after the other)."""
    logs: list[list[torch.Tensor]] = []
    saved = []
    for _, replay in actor.routing.routers:
        inner, log = replay.get_replay_topk, []

        def spy(*a: Any, inner: Callable = inner, log: list = log, **k: Any):
            probs, idx = inner(*a, **k)
            log.append(idx.detach().clone())
            return probs, idx

        replay.get_replay_topk = spy
        logs.append(log)
        saved.append(inner)
    try:
        out = fn()
    finally:
        for (_, replay), inner in zip(actor.routing.routers, saved, strict=True):
            replay.get_replay_topk = inner
    layers = [torch.cat([t.view(seq, -1, t.shape[-1]).transpose(0, 1) for t in log])
              for log in logs]
    order = sorted(range(len(layers)), key=lambda i: actor.routing.routers[i][0])
    return out, torch.stack([layers[i] for i in order], dim=2)


def with_routing(batch: TokenBatch, routed: torch.Tensor | None) -> TokenBatch:
    extras = {k: v for k, v in batch.extras.items() if k != ROUTED_EXPERTS}
    if routed is not None:
        extras[ROUTED_EXPERTS] = routed
    return TokenBatch(batch.input_ids, batch.labels, batch.loss_mask, batch.position_ids,
                      extras)


def replay_reference(init: str) -> dict[str, Any]:
    """One process: the natural routing and log-probs, then log-probs replaying it, a shifted
    (different) routing, and a half-given one (-1 rows routed naturally)."""
    actor = dist_cases.make_actor(REPLAY)
    load_checkpoint(actor, init, optimizer=False, rng=False)
    batch = dist_cases.fixed_batch(rows=4, seq=SEQ)
    (lp, _), natural = capture(actor, lambda: actor.compute_logprobs(batch))
    shifted = (natural + 1) % actor.spec.num_experts
    half = natural.clone()
    half[:, ::2] = -1
    out = {"natural": natural, "shifted": shifted, "lp": lp}
    for name, routed in (("natural", natural), ("shifted", shifted), ("half", half)):
        (out[f"lp_{name}"], _), out[f"used_{name}"] = capture(
            actor, lambda r=routed: actor.compute_logprobs(with_routing(batch, r)))
    return out


def replay_layout(overrides: list[str], init: str, routings: dict[str, torch.Tensor]
                  ) -> dict[str, Any]:
    """Log-probs replaying the given routings (every rank returns the whole batch), then one
    training step replaying the shifted routing."""
    actor = dist_cases.make_actor([*REPLAY, *overrides])
    load_checkpoint(actor, init, optimizer=False, rng=False)
    batch = dist_cases.fixed_batch(rows=4, seq=SEQ)
    out = {f"lp_{k}": actor.compute_logprobs(with_routing(batch, r))[0].cpu()
           for k, r in routings.items()}
    step = actor.train_step(with_routing(batch, routings.get("shifted")), lm_loss)
    out.update(loss=step["loss"], grad_norm=step["grad_norm"])
    return out


def engine_batches(init: str, batches: list[TokenBatch]) -> list[dict[str, Any]]:
    """For rollout batches (with the engine's routing): the trainer's log-probs and routing
    with and without replay."""
    actor = dist_cases.make_actor(["rl.routing_replay=true", f"model.seq_length={E2E_SEQ}",
                                   "train.micro_batch_size=1"])
    load_checkpoint(actor, init, optimizer=False, rng=False)
    out = []
    for batch in batches:
        seq = batch.seq_length
        (lp, _), used = capture(actor, lambda b=batch: actor.compute_logprobs(b), seq)
        (lp0, _), natural = capture(actor, lambda b=batch: actor.compute_logprobs(
            with_routing(b, None)), seq)
        out.append({"lp_replay": lp, "used": used, "lp_natural": lp0, "natural": natural})
    return out
