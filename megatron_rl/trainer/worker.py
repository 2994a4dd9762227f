"""The trainer side of the RL driver: one `TrainerWorker` per trainer rank (built and called
SPMD through `distributed.spmd.RankObjects`, on a local worker pool or under torchrun), around
the rank's `MegatronActor` for the life of the run."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_rl.checkpoint.errors import CheckpointError
from megatron_rl.checkpoint.training_checkpoint import (
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from megatron_rl.config.schema import Config
from megatron_rl.records.batch import TokenBatch
from megatron_rl.trainer.actor import MegatronActor
from megatron_rl.trainer.policy_update import policy_update, skipped_step
from megatron_rl.trainer.reference import ReferencePolicy
from megatron_rl.trainer.weight_sync import WeightSyncer, gatherer_for

# progress key of a checkpoint: the step folder the run's weights started from (its KL reference)
REFERENCE_KEY = "started_from"


class TrainerWorker:
    def __init__(self, cfg: Config, initial: str | None = None):
        """Build the actor: resumed from `checkpoint.load`, else started from the weights of
        `checkpoint.init_from` or `initial` (model.hf_path, converted by the driver). The KL
        reference is the weights the run started from, also after a resume."""
        self.cfg = cfg
        # scored as the engine samples: softmax(logits / rl.temperature)
        self.actor = MegatronActor(cfg, temperature=cfg.rl.temperature or 1.0)
        kl = bool(cfg.rl.loss.kl_coef)
        ck = cfg.checkpoint
        start = None if ck.load else ck.init_from or initial
        # a run from a fresh init has these as its reference (seeded: the same on resume)
        self.reference = ReferencePolicy(self.actor) if kl and not start else None
        self.progress: dict[str, Any] = {"step": 0}
        # the step folder the run started from, kept in its checkpoints (`latest` moves on)
        self.started_from = str(resolve_checkpoint(start).resolve()) if start else None
        if ck.load:
            self.progress = load_checkpoint(self.actor, ck.dir if ck.load == "latest"
                                            else ck.load)
            self.started_from = self.progress.get(REFERENCE_KEY)  # None: a fresh init
            if kl and self.started_from:
                self.reference = None  # freed before the swap below
                self.reference = self._reference_from(self.started_from)
        elif start:  # weights only: the run's own step, optimizer, data
            load_checkpoint(self.actor, start, optimizer=False, rng=False, resume=False)
            if kl:
                self.reference = ReferencePolicy(self.actor)
        self.syncer: WeightSyncer | None = None

    def _reference_from(self, source: str) -> ReferencePolicy:
        """The weights of `source` as the reference, the actor's own put back afterwards."""
        module = self.actor.model[0].module
        live = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()
                if isinstance(v, torch.Tensor)}
        hf_layout = self.actor.hf_layout
        try:
            load_checkpoint(self.actor, source, optimizer=False, rng=False, resume=False)
        except CheckpointError as e:
            raise CheckpointError(f"the KL reference of this resumed run is the weights it "
                                  f"started from, {source}, which cannot be loaded: {e}") from e
        reference = ReferencePolicy(self.actor)
        with torch.no_grad():  # in place: the optimizer's views of the parameters stay valid
            for k, v in module.state_dict().items():
                if k in live:
                    v.copy_(live[k])
        self.actor.hf_layout = hf_layout
        return reference

    def describe(self) -> dict[str, Any]:
        """The layout the driver needs (DP ranks; the multiple a sequence's length is padded
        to) and the progress of a resumed run."""
        return {"dp": self.actor.layout.dp, "seq_multiple": self.actor.seq_multiple,
                "progress": self.progress}

    def connect(self, urls: list[str]) -> bool:
        """Point weight sync at the engines (they may restart on new ports between runs).
        True when the ranks write the engines' parameters in place (`WeightSyncer.
        shares_parameters`): their owner may then hold them for each sync."""
        if self.syncer is not None:
            self.syncer.close()
        self.syncer = WeightSyncer(gatherer_for(self.actor), urls,
                                   transport=self.cfg.rl.sync_transport,
                                   bucket_bytes=self.cfg.rollout.bucket_mb << 20,
                                   fp8=self.cfg.rollout.sync_fp8,
                                   look_ahead=self.cfg.rollout.sync_look_ahead)
        return self.syncer.shares_parameters()

    def sync(self, version: int, held: list[str] | None = None) -> dict[str, float]:
        """`held`: the engines' segments, held by their owner (`WeightSyncer.sync`)."""
        if self.syncer is None:
            raise RuntimeError("TrainerWorker.sync before connect()")
        stats = self.syncer.sync(version, held)
        return {"sync/seconds": stats.seconds, "sync/gather_s": stats.gather_s,
                "sync/mb": stats.bytes / 1e6}

    def offload(self) -> dict[str, float]:
        """Colocated: the actor's GPU memory to host before the engines take the GPUs (on
        CPU only counted); `memory/offload_*` metrics."""
        return self.actor.offload().metrics()

    def onload(self) -> dict[str, float]:
        return self.actor.onload().metrics()

    def update(self, batch: TokenBatch | None, entropy_coef: float) -> dict[str, float]:
        """One run step's policy update (None: nothing to train on this step); `entropy_coef`
        comes from the driver (EntroPIC may move it away from `rl.loss.entropy_coef`)."""
        if batch is None:
            return skipped_step(self.actor)
        if self.actor.offloaded:
            raise RuntimeError("TrainerWorker.update while the actor is offloaded: onload "
                               "first (engines/colocation.py gives the order)")
        rl, train = self.cfg.rl, self.cfg.train
        loss = dataclasses.replace(rl.loss, entropy_coef=entropy_coef)
        return policy_update(self.actor, batch, loss, rl.tis, self.reference,
                             mini_batches=rl.mini_batches_per_step, epochs=rl.ppo_epochs,
                             rows_multiple=self.actor.layout.dp * train.micro_batch_size)

    def save(self, progress: dict[str, Any]) -> None:
        cfg = self.cfg.checkpoint
        offloaded = self.actor.offloaded  # colocated: between steps the actor is on host
        if offloaded:
            self.actor.onload()
        try:
            save_checkpoint(self.actor, cfg.dir, keep_last=cfg.keep_last,
                            progress={**progress, REFERENCE_KEY: self.started_from})
        finally:
            if offloaded:
                self.actor.offload()

    def close(self) -> None:
        if self.syncer is not None:
            self.syncer.close()
            self.syncer = None
