"""The trainer side of the RL driver: one `TrainerWorker` per trainer rank (built and called
SPMD through `distributed.spmd.RankObjects`, on a local worker pool or under torchrun), around
the rank's `MegatronActor` for the life of the run."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_rl.checkpoint.training_checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.config.schema import Config
from megatron_rl.records.batch import TokenBatch
from megatron_rl.trainer.actor import MegatronActor
from megatron_rl.trainer.policy_update import policy_update
from megatron_rl.trainer.reference import ReferencePolicy
from megatron_rl.trainer.weight_sync import WeightSyncer, gatherer_for


class TrainerWorker:
    def __init__(self, cfg: Config, initial: str | None = None):
        """Build the actor: resumed from `checkpoint.load`, else started from the weights of
        `checkpoint.init_from` or `initial` (model.hf_path, converted by the driver)."""
        self.cfg = cfg
        self.actor = MegatronActor(cfg)
        # the run's initial policy, also when resuming (taken before loading)
        self.reference = ReferencePolicy(self.actor) if cfg.rl.loss.kl_coef else None
        self.progress: dict[str, Any] = {"step": 0}
        ck = cfg.checkpoint
        if ck.load:
            self.progress = load_checkpoint(self.actor, ck.dir if ck.load == "latest"
                                            else ck.load)
        elif ck.init_from or initial:  # weights only: the run's own step, optimizer, data
            load_checkpoint(self.actor, ck.init_from or initial, optimizer=False, rng=False,
                            resume=False)
        self.syncer: WeightSyncer | None = None

    def describe(self) -> dict[str, Any]:
        """The layout the driver needs and the progress of a resumed run."""
        return {"dp": self.actor.layout.dp, "progress": self.progress}

    def connect(self, urls: list[str]) -> None:
        """Point weight sync at the engines (they may restart on new ports between runs)."""
        if self.syncer is not None:
            self.syncer.close()
        self.syncer = WeightSyncer(gatherer_for(self.actor), urls,
                                   transport=self.cfg.rl.sync_transport,
                                   bucket_bytes=self.cfg.rollout.bucket_mb << 20)

    def sync(self, version: int) -> dict[str, float]:
        if self.syncer is None:
            raise RuntimeError("TrainerWorker.sync before connect()")
        stats = self.syncer.sync(version)
        return {"sync/seconds": stats.seconds, "sync/gather_s": stats.gather_s,
                "sync/mb": stats.bytes / 1e6}

    def update(self, batch: TokenBatch, entropy_coef: float) -> dict[str, float]:
        """One run step's policy update; `entropy_coef` comes from the driver (EntroPIC may
        move it away from `rl.loss.entropy_coef`)."""
        rl, train = self.cfg.rl, self.cfg.train
        loss = dataclasses.replace(rl.loss, entropy_coef=entropy_coef)
        return policy_update(self.actor, batch, loss, rl.tis, self.reference,
                             mini_batches=rl.mini_batches_per_step, epochs=rl.ppo_epochs,
                             rows_multiple=self.actor.layout.dp * train.micro_batch_size)

    def save(self, progress: dict[str, Any]) -> None:
        cfg = self.cfg.checkpoint
        save_checkpoint(self.actor, cfg.dir, progress=progress, keep_last=cfg.keep_last)

    def close(self) -> None:
        if self.syncer is not None:
            self.syncer.close()
            self.syncer = None
