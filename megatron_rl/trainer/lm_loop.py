"""Next-token training on a token stream: the smallest real Megatron job (and the quickstart's
first slice). Runs SPMD on every rank; resumable from the last checkpoint.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from megatron_rl.checkpoint.training_checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from megatron_rl.config.schema import Config
from megatron_rl.data.synthetic import ArithmeticSequences
from megatron_rl.trainer.actor import MegatronActor
from megatron_rl.trainer.losses import lm_loss
from megatron_rl.utils.metrics import MetricsLogger


def run_lm_training(cfg: Config, stop_after: int | None = None) -> list[dict[str, Any]]:
    """Train `cfg.train.steps` steps (or stop early after `stop_after`); return metrics rows."""
    actor = MegatronActor(cfg)
    data = ArithmeticSequences(actor.spec.vocab_size, cfg.model.seq_length, seed=cfg.train.seed)
    cursor = 0
    load = cfg.checkpoint.load
    if load == "latest":
        load = latest_checkpoint(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    if load:
        cursor = load_checkpoint(actor, load, verify=cfg.checkpoint.verify).get("cursor", 0)
    logger = MetricsLogger(cfg.train.output_dir, enabled=dist.get_rank() == 0,
                           resume_from=actor.step if actor.step > 0 else None)
    rows = []
    while actor.step < cfg.train.steps:
        t0 = time.time()
        batch = data.batch(cursor, cfg.train.global_batch_size)
        metrics = actor.train_step(batch, lm_loss)
        cursor += batch.rows
        metrics["step_time_s"] = time.time() - t0
        metrics["tokens_per_s"] = metrics["num_tokens"] / metrics["step_time_s"]
        rows.append({"step": actor.step, **metrics})
        if actor.step % cfg.train.log_every == 0:
            logger.log(actor.step, metrics, ("loss", "grad_norm", "lr", "entropy",
                                             "tokens_per_s"))
        every, done = cfg.checkpoint.save_every, actor.step == cfg.train.steps
        if cfg.checkpoint.dir and ((every and actor.step % every == 0) or done):
            save_checkpoint(actor, cfg.checkpoint.dir, {"cursor": cursor},
                            keep_last=cfg.checkpoint.keep_last)
        if stop_after is not None and actor.step >= stop_after:
            break
    logger.plot(("loss", "grad_norm", "entropy", "lr", "tokens_per_s"), "lm_curves.png")
    return rows
