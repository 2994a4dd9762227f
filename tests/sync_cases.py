"""Job bodies for weight-sync tests (run inside the worker pools)."""

from __future__ import annotations

import asyncio

import torch
import torch.distributed as dist

from megatron_rl.checkpoint.training_checkpoint import load_checkpoint
from megatron_rl.engines.base import GenerateRequest, SamplingParams
from megatron_rl.engines.http_client import HttpEngine
from megatron_rl.records.batch import TokenBatch
from megatron_rl.trainer.losses import lm_loss
from megatron_rl.trainer.weight_sync import WeightSyncer, gatherer_for
from tests import dist_cases

PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12]
NEW_TOKENS = 16  # prompt + output = 25 tokens → 24 inputs, divisible by TP2 (SP)


def _generate(url: str) -> tuple[list[int], list[float], list[int]]:
    async def run():
        req = GenerateRequest("probe", PROMPT, SamplingParams(
            temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=11))
        return await HttpEngine(url).generate(req)

    out = asyncio.run(run())
    return out.output_ids, out.output_logprobs, out.weight_versions


def _broadcast(obj):
    box = [obj]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def trainer_logprobs(actor, ids: list[int]) -> list[float]:
    tokens = torch.tensor([PROMPT + ids] * 2)
    logp, _ = actor.compute_logprobs(TokenBatch.from_sequences(tokens))
    return logp[0, len(PROMPT) - 1:].tolist()


def _loaded_actor(overrides: list[str], init: str):
    actor = dist_cases.make_actor(["model.seq_length=24", "train.global_batch_size=2",
                                   *overrides])
    load_checkpoint(actor, init, optimizer=False, rng=False)
    return actor


_KEPT: dict = {}  # a rank's actor and syncer between the jobs of one test


def stepped_syncer(overrides: list[str], init: str, url: str) -> bool:
    """An actor one optimizer step past `init` and its one-copy syncer, kept on the rank for
    `kept_sync` / `kept_logprobs`; whether the ranks write the engine's parameters."""
    actor = _loaded_actor(overrides, init)
    actor.train_step(dist_cases.fixed_batch(rows=2, seq=24), lm_loss)
    syncer = WeightSyncer(gatherer_for(actor), [url], transport="tensor")
    _KEPT.update(actor=actor, syncer=syncer)
    return syncer.shares_parameters()


def kept_sync(version: int, held: list[str] | None) -> int:
    return _KEPT["syncer"].sync(version, held).tensors


def kept_logprobs(ids: list[int]) -> list[float]:
    """The kept actor's log-probs of PROMPT + ids; drops what was kept."""
    _KEPT.pop("syncer").close()
    return trainer_logprobs(_KEPT.pop("actor"), ids)


def step_sync_probe(overrides: list[str], init: str, url: str, transport: str,
                    version: int, disk_dir: str, sync_first: bool = False) -> dict:
    """One optimizer step, then: engine log-probs before the sync, sync, engine log-probs after;
    the trainer's log-probs of the same tokens, the same on every rank; this rank's sync
    stats (what it sent, how many layers it gathered from other ranks) and whether its gather
    crosses ranks (what the look-ahead is for).
    `sync_first`: the same syncer also syncs once before the step (version - 1), so the
    second sync shows what a run's later syncs send."""
    actor = _loaded_actor(overrides, init)
    one_copy = transport != "tensor-http"  # the bucketed tensor path even on loopback
    with WeightSyncer(gatherer_for(actor), [url], transport=transport.removesuffix("-http"),
                      bucket_bytes=64 << 10, disk_dir=disk_dir, one_copy=one_copy) as syncer:
        if sync_first:
            syncer.sync(version - 1)
        actor.train_step(dist_cases.fixed_batch(rows=2, seq=24), lm_loss)
        before = _broadcast(_generate(url) if dist.get_rank() == 0 else None)
        stats = syncer.sync(version)
    after = _broadcast(_generate(url) if dist.get_rank() == 0 else None)

    return {"before": before, "after": after, "trainer_before": trainer_logprobs(actor, before[0]),
            "trainer_after": trainer_logprobs(actor, after[0]), "tensors": stats.tensors,
            "bytes": stats.bytes, "gathered_layers": stats.extra["gathered_layers"],
            "crosses_ranks": syncer.gatherer.crosses_ranks(syncer.one_sender)}


def yield_order(overrides: list[str], init: str) -> list[tuple[str, int]]:
    """Rank 0's `hf_tensors(one_sender=True)`: each (HF name, layer groups gathered from
    other ranks before it was yielded); every rank drives the iterator."""
    gatherer = gatherer_for(_loaded_actor(overrides, init))
    return [(name, gatherer.stats.extra["gathered_layers"])
            for name, _ in gatherer.hf_tensors(one_sender=True)]
