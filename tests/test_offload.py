"""Trainer offload/onload for colocated engines (trainer/offload.py): after offload + onload the
actor's parameters, gradient buffers and Adam state are the bytes they were, and training goes
on exactly as an actor that never moved. Run with the real release on CPU (storages shrunk to
zero and grown back; weight sync meanwhile reads the host copies), and in the default CPU mode
that only counts bytes."""

from __future__ import annotations

import torch

from megatron_rl.trainer.losses import lm_loss
from megatron_rl.trainer.offload import actor_tensors
from megatron_rl.trainer.weight_sync import gatherer_for
from tests import dist_cases
from tests.pools import get_pool


def _snapshot(actor) -> list[torch.Tensor]:
    return [t.detach().clone() for _, t in actor_tensors(actor.model, actor.optimizer)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def offload_job() -> dict:
    moved, still = dist_cases.make_actor([]), dist_cases.make_actor([])
    with torch.no_grad():  # the same start (seeded init, but make it certain)
        for p, q in zip(still.model[0].parameters(), moved.model[0].parameters(), strict=True):
            p.copy_(q)
    batch = dist_cases.fixed_batch()
    losses = [[m.train_step(batch, lm_loss)["loss"] for m in (moved, still)]]
    before = _snapshot(moved)  # Adam state exists now (after a step)
    gatherer = gatherer_for(moved)
    hf_before = {n: t.clone() for n, t in gatherer.hf_tensors()}
    off = moved.offload(release=True)
    params = list(moved.model[0].parameters())
    freed = all(p.untyped_storage().nbytes() == 0 for p in params)
    # weight sync between offload and onload reads the host copies
    hf_offloaded = dict(gatherer.hf_tensors())
    sync_exact = hf_offloaded.keys() == hf_before.keys() and all(
        torch.equal(hf_offloaded[n], t) for n, t in hf_before.items())
    on = moved.onload()
    exact = _same(before, _snapshot(moved))
    counted = moved.offload()  # CPU default: counts, moves nothing
    untouched = all(p.untyped_storage().nbytes() > 0 for p in params)
    moved.onload()
    for _ in range(2):
        losses.append([m.train_step(batch, lm_loss)["loss"] for m in (moved, still)])
    same_params = all(torch.equal(p, q) for p, q in zip(
        moved.model[0].parameters(), still.model[0].parameters(), strict=True))
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    return {"off": off.bytes, "on": on.bytes, "released": off.released,
            "counted": counted.bytes, "counted_released": counted.released, "freed": freed,
            "exact": exact, "sync_exact": sync_exact, "untouched": untouched, "losses": losses,
            "same_params": same_params, "param_bytes": param_bytes,
            "metrics": off.metrics()}


def test_offload_onload_is_exact_and_training_continues_identically():
    r = get_pool(1).run(offload_job)[0]
    print(f"\noffload bytes {r['off']}; losses (moved, never moved) {r['losses']}")
    assert r["released"] and r["freed"] and r["exact"] and r["sync_exact"]
    assert r["off"] == r["on"] == r["counted"]
    assert not r["counted_released"] and r["untouched"]
    # fp32 params: the optimizer's params are the model's own (counted once, as model);
    # main_grad is fp32 like the params; Adam keeps two moments per parameter
    assert r["off"]["model"] == r["param_bytes"]
    assert r["off"]["grads"] == r["param_bytes"]
    assert r["off"]["optimizer"] >= 2 * r["param_bytes"]
    assert r["metrics"]["memory/offload_model_mb"] == r["param_bytes"] / 1e6
    for moved, still in r["losses"]:
        assert moved == still
    assert r["losses"][-1][0] != r["losses"][0][0]  # it did keep training
    assert r["same_params"]
