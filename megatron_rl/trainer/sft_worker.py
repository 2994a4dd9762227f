"""The trainer side of `megatron-rl sft`: one `SFTWorker` per trainer rank (built and called
SPMD through `distributed.spmd.RankObjects`), around the rank's `MegatronActor`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_rl.checkpoint.training_checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.config.schema import Config
from megatron_rl.records.batch import TokenBatch
from megatron_rl.trainer.actor import MegatronActor
from megatron_rl.trainer.losses import lm_loss


class SFTWorker:
    def __init__(self, cfg: Config, initial: str | None = None):
        """Build the actor: resumed from `checkpoint.load` (a folder, or a run folder's
        latest), else started from the weights of `checkpoint.init_from` or `initial`
        (model.hf_path, converted by the driver)."""
        self.cfg = cfg
        self.actor = MegatronActor(cfg)
        self.progress: dict[str, Any] = {"step": 0}
        ck = cfg.checkpoint
        if ck.load:
            self.progress = load_checkpoint(self.actor, ck.dir if ck.load == "latest"
                                            else ck.load, verify=ck.verify)
        elif ck.init_from or initial:  # weights only: the run's own step, optimizer, data
            load_checkpoint(self.actor, ck.init_from or initial, optimizer=False, rng=False,
                            resume=False, verify=ck.verify)

    def describe(self) -> dict[str, Any]:
        return {"dp": self.actor.layout.dp, "progress": self.progress}

    def train(self, batch: TokenBatch) -> dict[str, float]:
        return self.actor.train_step(batch, lm_loss)

    def evaluate(self, batches: Sequence[TokenBatch]) -> dict[str, float]:
        """The token-mean loss over all `batches` (each batch's mean weighted by its tokens)."""
        total = tokens = entropy = 0.0
        for batch in batches:
            m = self.actor.evaluate(batch, lm_loss)
            total += m["loss"] * m["num_tokens"]
            entropy += m.get("entropy", 0.0) * m["num_tokens"]
            tokens += m["num_tokens"]
        tokens = max(tokens, 1.0)
        return {"eval/loss": total / tokens, "eval/entropy": entropy / tokens,
                "eval/tokens": tokens}

    def save(self, progress: dict[str, Any]) -> None:
        ck = self.cfg.checkpoint
        save_checkpoint(self.actor, ck.dir, progress=progress, keep_last=ck.keep_last)
