"""`megatron-rl sft RECIPE [overrides]`: supervised fine-tuning, top-down.

files (trajectory JSONL, chat parquet/JSONL; `data/sft_data.py`) → sequences with a loss mask
on the assistant's tokens only → batches of `train.global_batch_size` sequences, in a seeded
order per epoch → Megatron next-token steps (`lm_loss`; token-budget micro-batches and packing
as in RL) → held-out loss every `sft.eval_every` steps (and before the first).

The driver process reads and tokenizes the data and owns the data cursor; the trainer ranks
(a local worker pool, or torchrun) each keep an `SFTWorker`. Checkpoints, resume
(`checkpoint.load=latest`), `checkpoint.init_from`, `model.hf_path` initial weights, metrics
(metrics.jsonl, sft_curves.png) and HF export (`checkpoint.export_hf[_every]`) work as in
`megatron-rl train`; a checkpoint keeps the cursor, so a resumed run trains on the same
sequences an uninterrupted one would have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

from megatron_rl.agents.tokenizer import pad_id, run_tokenizer
from megatron_rl.checkpoint.training_checkpoint import latest_checkpoint
from megatron_rl.config.schema import Config
from megatron_rl.data.parquet import DataError
from megatron_rl.data.sft_data import SFTData, load_sft_data, sft_batch
from megatron_rl.distributed.spmd import RankObjects, SPMDGroup
from megatron_rl.models.registry import model_spec
from megatron_rl.trainer.hf_weights import (
    checkpoint_due,
    export_step,
    initial_weights,
    save_run_tokenizer,
)
from megatron_rl.trainer.sft_worker import SFTWorker
from megatron_rl.utils.metrics import MetricsLogger

CONSOLE = ("loss", "eval/loss", "grad_norm", "lr", "tokens_per_s")
CURVES = ("loss", "eval/loss", "grad_norm", "entropy", "lr", "tokens_per_s")


def _data(cfg: Config, files: tuple[str, ...], tokenizer: Any, vocab: int,
          context_weight: float = 0.0, copy_weight: float = 1.0) -> SFTData:
    return load_sft_data(files, tokenizer, seq_length=cfg.model.seq_length, vocab_size=vocab,
                         fmt=cfg.sft.format, overlong=cfg.sft.overlong,
                         context_weight=context_weight, system_share=cfg.sft.system_loss_share,
                         context_share=cfg.sft.context_loss_share, copy_weight=copy_weight,
                         seed=cfg.train.seed)


def _resolved(cfg: Config, sequences: int) -> Config:
    """`sft.epochs` → train.steps; `checkpoint.load=latest` with nothing saved yet starts fresh
    (so one command line both starts and resumes a job)."""
    ck, steps = cfg.checkpoint, cfg.train.steps
    if cfg.sft.epochs:
        steps = max(1, math.ceil(cfg.sft.epochs * sequences / cfg.train.global_batch_size))
    if ck.load == "latest" and (not ck.dir or latest_checkpoint(ck.dir) is None):
        print(f"[megatron-rl] checkpoint.load=latest: nothing saved in {ck.dir}; starting "
              "fresh", flush=True)
        ck = dataclasses.replace(ck, load=None)
    return dataclasses.replace(cfg, checkpoint=ck, train=dataclasses.replace(
        cfg.train, steps=steps))


def sft(cfg: Config, group: SPMDGroup) -> list[dict[str, Any]]:
    """The loop; `group.run(fn, *args)` runs `fn` on every trainer rank. Returns the metrics
    rows (a step-0 row with the held-out loss before training first, when evaluating)."""
    s, out = cfg.sft, Path(cfg.train.output_dir)
    if not s.train_files:
        raise DataError("sft.train_files: no training data given (trajectory .jsonl, or chat "
                        ".parquet/.jsonl with a `messages` column; docs/sft.md)")
    out.mkdir(parents=True, exist_ok=True)
    spec = model_spec(cfg.model)
    tokenizer = run_tokenizer(cfg.model.hf_path, cfg.model.name, spec.vocab_size)
    # held-out loss stays on the assistant's tokens alone, whatever the training weights
    data = _data(cfg, s.train_files, tokenizer, spec.vocab_size, s.context_loss_weight,
                 s.copy_loss_weight)
    held_out = _data(cfg, s.val_files, tokenizer, spec.vocab_size) if s.val_files else None
    print(f"[megatron-rl] SFT data: {data.stats}" +
          (f"; held out: {held_out.stats}" if held_out else ""), flush=True)
    cfg = _resolved(cfg, len(data))
    gbs, pad = cfg.train.global_batch_size, pad_id(tokenizer)
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as cleanup:
        trainer = RankObjects(group, SFTWorker, cfg, initial_weights(cfg, spec))
        cleanup.callback(trainer.close)
        info = trainer.call("describe")[0]
        start, cursor = int(info["progress"].get("step", 0)), int(info["progress"].get(
            "sft_cursor", 0))
        multiple = info["dp"] * cfg.train.micro_batch_size
        logger = MetricsLogger(out, resume_from=start or None, sinks=s.loggers)
        cleanup.callback(logger.close)
        eval_batches = []
        if held_out is not None and s.eval_every:
            chosen = held_out.examples[:s.eval_sequences or None]
            eval_batches = [sft_batch(chosen[i:i + gbs], pad_id=pad, rows_multiple=multiple)
                            for i in range(0, len(chosen), gbs)]
        if eval_batches and start == 0:
            before = trainer.call("evaluate", eval_batches)[0]
            logger.log(0, before, console_keys=("eval/loss",))
            rows.append({"step": 0, **before})
        for step in range(start, cfg.train.steps):
            t0 = time.perf_counter()
            examples = data.take(cursor, gbs, seed=cfg.train.seed, shuffle=s.shuffle)
            cursor += gbs
            metrics = trainer.call("train", sft_batch(examples, pad_id=pad,
                                                      rows_multiple=multiple))[0]
            metrics.pop("step", None)  # the actor's float count; rows carry the int
            t1 = time.perf_counter()
            if eval_batches and (step + 1) % s.eval_every == 0:
                metrics.update(trainer.call("evaluate", eval_batches)[0])
            metrics.update({"epoch": cursor / len(data), "time/train": t1 - t0,
                            "time/step": time.perf_counter() - t0,
                            "tokens_per_s": metrics["num_tokens"] / max(t1 - t0, 1e-9)})
            logger.log(step + 1, metrics, console_keys=CONSOLE)
            rows.append({"step": step + 1, **metrics})
            save, export = checkpoint_due(cfg.checkpoint, step + 1, cfg.train.steps)
            if save:
                trainer.call("save", {"sft_cursor": cursor})
            if export:
                export_step(cfg, spec, step + 1, Path(cfg.model.hf_path or
                                                      save_run_tokenizer(tokenizer, out)))
        logger.plot(CURVES, "sft_curves.png")
    return rows
