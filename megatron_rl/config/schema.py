"""Typed run configuration.

Every section is a plain dataclass; ranges and choices live in field metadata so the loader can
validate any field generically and name it in the error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, choices: tuple | None = None, help: str = "") -> Any:
    """A dataclass field with a validated range or set of choices."""
    meta = {k: v for k, v in dict(ge=ge, gt=gt, le=le, choices=choices).items() if v is not None}
    meta["help"] = help
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    name: str = bounded("tiny-moe", help="registry entry: configs/models/<name>.yaml")
    dtype: str = bounded("fp32", choices=("fp32", "bf16", "fp16"))
    seq_length: int = bounded(128, ge=8, help="longest packed sequence the trainer sees")
    recompute_activations: bool = False
    layer_impl: str = bounded("auto", choices=("auto", "local", "transformer_engine"),
                              help="auto: Transformer Engine when it imports with CUDA, else local")


@dataclass
class ParallelConfig:
    tp: int = bounded(1, ge=1, help="tensor parallel")
    pp: int = bounded(1, ge=1, help="pipeline parallel")
    ep: int = bounded(1, ge=1, help="expert parallel")
    etp: int = bounded(1, ge=1, help="expert tensor parallel")
    cp: int = bounded(1, ge=1, help="context parallel")
    sp: bool | None = bounded(None, help="sequence parallel; None = on whenever tp > 1")
    distributed_optimizer: bool = False
    moe_dispatcher: str = bounded("alltoall", choices=("alltoall", "allgather"))
    backend: str = bounded("auto", choices=("auto", "gloo", "nccl"))

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1 if self.sp is None else bool(self.sp and self.tp > 1)


@dataclass
class OptimConfig:
    lr: float = bounded(1e-6, gt=0)
    min_lr: float = bounded(0.0, ge=0)
    weight_decay: float = bounded(0.0, ge=0)
    adam_beta1: float = bounded(0.9, ge=0, le=1)
    adam_beta2: float = bounded(0.98, ge=0, le=1)
    adam_eps: float = bounded(1e-8, gt=0)
    clip_grad: float = bounded(1.0, ge=0, help="0 disables clipping")
    warmup_steps: int = bounded(0, ge=0)
    lr_decay_style: str = bounded("constant", choices=("constant", "linear", "cosine"))


@dataclass
class TrainConfig:
    steps: int = bounded(10, ge=1)
    global_batch_size: int = bounded(8, ge=1, help="sequences per optimizer step, all ranks")
    micro_batch_size: int = bounded(1, ge=1)
    seed: int = 1234
    log_every: int = bounded(1, ge=1)
    logprob_chunk_tokens: int = bounded(4096, ge=1,
                                        help="tokens per chunk when computing log-probs")
    output_dir: str = bounded("runs/default", help="metrics.jsonl and plots go here")


@dataclass
class CheckpointConfig:
    dir: str | None = bounded(None, help="where step_XXXXXX/ folders go; None = no saving")
    save_every: int = bounded(0, ge=0, help="steps between saves; 0 = only at the end")
    load: str | None = bounded(None, help="a checkpoint folder, or 'latest' (from dir)")
    keep_last: int = bounded(2, ge=1)
    verify: str = bounded("crc32", choices=("size", "crc32"),
                          help="integrity check of every file on load")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def check(self) -> None:
        """Cross-field rules the per-field metadata cannot express."""
        from megatron_rl.config.loader import ConfigError

        t = self.train
        if t.global_batch_size % t.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={t.micro_batch_size}")
        if self.optim.min_lr > self.optim.lr:
            raise ConfigError(f"optim.min_lr={self.optim.min_lr} exceeds optim.lr={self.optim.lr}")
        if self.model.dtype == "fp16":
            raise ConfigError("model.dtype=fp16 is not supported (use bf16 or fp32)")
