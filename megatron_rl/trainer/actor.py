"""The Megatron actor: one rank's share of the policy, its optimizer and its train step."""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config.schema import Config
from megatron_rl.distributed.process_groups import Layout, init_model_parallel
from megatron_rl.models.builder import DTYPES, build_gpt_model, logprob_output_processor
from megatron_rl.models.registry import ModelSpec, model_spec
from megatron_rl.models.routing_replay import RoutingReplay
from megatron_rl.records.batch import ROUTED_EXPERTS, LossFn, TokenBatch
from megatron_rl.trainer.microbatching import (
    MicroBatch,
    RowPositionRoPE,
    assemble,
    log_once,
    loss_inputs,
    micro_batches,
    packing_unsupported,
)
from megatron_rl.trainer.offload import MoveStats, Offloader, torch_optimizers

logger = logging.getLogger(__name__)

# reported-metric keys of a loss's token means and their count (`LossOutput.token_metrics`)
TOKEN_MEAN, MASKED_TOKENS = "token_mean/", "token_mean/__count__"


def freeze(module: torch.nn.Module, patterns: Sequence[str]) -> list[str]:
    """Parameters whose name matches any of `patterns` (re.search) stop training: DDP gives
    them no grad buffer and the optimizer no state. A pattern that matches nothing, or one
    that leaves nothing to train, is an error naming it. Returns the frozen names."""
    names = [n for n, _ in module.named_parameters()]
    regexes = []
    for pattern in patterns:
        try:
            regexes.append(re.compile(pattern))
        except re.error as e:
            raise ValueError(f"optim.frozen: {pattern!r} is not a regular expression: {e}"
                             ) from e
        if not any(regexes[-1].search(n) for n in names):
            raise ValueError(f"optim.frozen: {pattern!r} matches no parameter (e.g. "
                             f"{', '.join(names[:3])})")
    frozen = [n for n in names if any(r.search(n) for r in regexes)]
    if patterns and len(frozen) == len(names):
        raise ValueError(f"optim.frozen={list(patterns)} freezes every parameter")
    for name, param in module.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return frozen


class MegatronActor:
    """Builds model + DDP + optimizer + LR schedule for this rank and runs steps on them.

    Every rank of the job constructs one and calls the same methods with the same global batch;
    each rank keeps only its data-parallel shard.
    """

    def __init__(self, cfg: Config, spec: ModelSpec | None = None, *,
                 temperature: float = 1.0):
        """`temperature`: log-probs, entropy and the loss are those of softmax(logits / T),
        the distribution the engine sampled from (verl's logits / T); 1 for SFT."""
        from megatron_rl.models import cpu_compat

        cpu_compat.import_megatron()  # first, so that a CPU process skips the compile wrappers
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.distributed.distributed_data_parallel_config import (
            DistributedDataParallelConfig,
        )

        if temperature <= 0:
            raise ValueError(f"temperature={temperature}: log-probs need T > 0 (greedy "
                             "sampling has none to train on)")
        self.cfg = cfg
        self.temperature = temperature
        self.spec = spec or model_spec(cfg.model)
        self.layout: Layout = init_model_parallel(cfg.parallel, cfg.train.seed)
        if self.spec.is_moe and self.spec.num_experts % cfg.parallel.ep:
            raise ValueError(f"parallel.ep={cfg.parallel.ep} does not divide the "
                             f"{self.spec.num_experts} experts of {self.spec.name}")
        # MoE routing replay (R3): batches carrying the engine's routing are routed by it
        replay = self.spec.is_moe and getattr(cfg.rl, "routing_replay", False)
        module = build_gpt_model(self.spec, cfg.model, cfg.parallel,
                                 **({"moe_enable_routing_replay": True} if replay else {}))
        self.config = module.config
        self.routing = RoutingReplay([module], self.config) if replay else None
        freeze(module, cfg.optim.frozen)
        # no per-bucket NaN check before the reduction (it raises on the rank that sees one
        # while the others wait in the collective): the optimizer skips a non-finite norm
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.parallel.distributed_optimizer,
            check_for_nan_in_grad=False)
        self.model = [DistributedDataParallel(self.config, ddp_config, module)]
        self.optimizer = self._build_optimizer()
        self.scheduler = self._build_scheduler()
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.no_sync_func = self.model[0].no_sync
        self.step = 0
        # the HF expert layout per tensor group of the checkpoint this model came from (a
        # converted folder's manifest); kept in its checkpoints so an export writes it back
        self.hf_layout: dict[str, str] | None = None
        self._stepped = False  # an optimizer step of the current run step succeeded
        self.optimizer_steps = 0  # successful updates: Adam's bias-correction step
        self.forward_backward_seconds = 0.0  # in megatron's schedules (all passes)
        self._setup_micro_batching(module)

    # -- construction ------------------------------------------------------------------------
    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o, dtype = self.cfg.optim, DTYPES[self.cfg.model.dtype]
        config = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
            clip_grad=o.clip_grad, bf16=dtype == torch.bfloat16, params_dtype=dtype,
            use_distributed_optimizer=self.cfg.parallel.distributed_optimizer,
            optimizer_cpu_offload=o.cpu_offload_fraction > 0,
            optimizer_offload_fraction=o.cpu_offload_fraction)
        from megatron.core.optimizer import ChainedOptimizer

        optimizer = get_megatron_optimizer(config, self.model)
        if not isinstance(optimizer, ChainedOptimizer):  # its step always computes the norm
            optimizer = ChainedOptimizer([optimizer])
        _skip_non_finite(optimizer)
        for inner in torch_optimizers(optimizer):
            if isinstance(inner, torch.optim.Adam):  # AdamW too
                _foreach(inner)
                inner.register_load_state_dict_post_hook(_foreach)  # a checkpoint's groups
        return optimizer

    def _build_scheduler(self):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o, steps = self.cfg.optim, self.cfg.train.steps
        decay_steps = max(o.lr_decay_steps or steps, o.warmup_steps + 1)
        # megatron warms up from init_lr at step 0: start at lr/(W+1), not 0, so the first
        # step of a warmup trains (with init_lr=0 it changed nothing)
        return OptimizerParamScheduler(
            self.optimizer, init_lr=o.lr / (o.warmup_steps + 1), max_lr=o.lr,
            min_lr=o.min_lr, lr_warmup_steps=o.warmup_steps, lr_decay_steps=decay_steps,
            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=decay_steps, wd_incr_style="constant")

    def _setup_micro_batching(self, module) -> None:
        """Token-budget micro-batches and packing (trainer/microbatching.py), from the config."""
        train, parallel = self.cfg.train, self.cfg.parallel
        budget = int(getattr(train, "max_tokens_per_microbatch", 0) or 0)
        self.pack, self.rope = False, None
        if getattr(train, "pack_sequences", False):
            reason = packing_unsupported(self.spec, self.cfg)
            if reason:
                log_once(f"train.pack_sequences: {self.spec.name} falls back to padded rows: "
                         f"{reason}")
            else:
                self.pack = True
                budget = budget or train.micro_batch_size * self.cfg.model.seq_length
                self.rope = RowPositionRoPE(module.rotary_pos_emb)
        self.token_budget = budget
        self.share_prefixes = self.pack and bool(getattr(train, "share_prefixes", False))
        # sequence parallelism splits the sequence over TP, context parallelism in 2*CP chunks
        self.seq_multiple = ((parallel.tp if parallel.sequence_parallel else 1)
                             * (2 * parallel.cp if parallel.cp > 1 else 1))
        # the allgather dispatcher all-gathers equal token counts over the EP group
        self.uniform_shapes = parallel.ep > 1 and parallel.moe_dispatcher == "allgather"
        # padding stays out of the MoE load-balancing loss (megatron's padding_mask); a later
        # pipeline stage would receive it unscattered under sequence parallelism
        self.moe_padding_mask = self.spec.is_moe and not (
            parallel.pp > 1 and parallel.sequence_parallel)

    # -- steps -------------------------------------------------------------------------------
    def train_step(self, batch: TokenBatch, loss_fn: LossFn, *, end_step: bool = True
                   ) -> dict[str, float]:
        """One optimizer step on a global batch (every rank passes the same batch).

        A run's step may take several optimizer steps (PPO mini-batches): pass
        `end_step=False` to all but the last, or call `end_step()` after them."""
        self._set_training(True)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        metrics = self._forward_backward(batch, loss_fn, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.optimizer_steps += 1
        self._stepped = self._stepped or ok
        metrics.update(grad_norm=float(grad_norm or 0.0), skipped=float(not ok))
        if end_step:
            metrics.update(self.end_step())
        return metrics

    def end_step(self) -> dict[str, float]:
        """Close a run step: the LR schedule advances once if any optimizer step succeeded.
        Reports the LR this step trained with."""
        used = self.optimizer.param_groups[0]["lr"]
        if self._stepped:
            self.scheduler.step(increment=1)
        self._stepped = False
        self.step += 1
        return {"lr": used, "step": float(self.step)}

    @torch.no_grad()
    def evaluate(self, batch: TokenBatch, loss_fn: LossFn) -> dict[str, float]:
        self._set_training(False)
        return self._forward_backward(batch, loss_fn, forward_only=True)

    @torch.no_grad()
    def compute_logprobs(self, batch: TokenBatch, *, trained_only: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy of `batch.labels` for the whole batch, on every rank, as
        [rows, seq] in the batch's row order. With token-budget micro-batches positions after
        a row's last trained target (and rows that train nothing) are not computed: 0.
        `trained_only`: only the trained targets go through the output layer (the others are
        0), as in training: what old and reference log-probs need."""
        full = self._forward_collect(batch, self._logprob_processor(), trained_only)
        return full[..., 0], full[..., 1]

    @torch.no_grad()
    def compute_logits(self, batch: TokenBatch) -> torch.Tensor:
        """Full-vocabulary logits [rows, seq, vocab] on every rank (for checks, not training:
        it materialises what `compute_logprobs` avoids)."""
        return self._forward_collect(batch, partial(_gathered_logits,
                                                    vocab=self.spec.vocab_size))

    # -- internals ---------------------------------------------------------------------------
    def _set_training(self, training: bool) -> None:
        """Every chunk in train or eval mode, walking its modules only when that changes (only
        the actor switches them; a walk costs ~0.2 ms a step on the test model)."""
        for chunk in self.model:
            if chunk.training != training:
                chunk.train(training)

    def _forward_collect(self, batch: TokenBatch, processor, trained_only: bool = False
                         ) -> torch.Tensor:
        """Forward-only pass whose per-token outputs (from `processor`) come back for the
        whole batch on every rank: last pipeline stage → all stages, DP shards gathered."""
        from megatron.core import parallel_state as ps

        self._set_training(False)
        micro = self._micro_batches(batch)
        outputs = self._schedule(micro, lambda mb, out, non_loss_data=False: out,
                                 forward_only=True, collect=True, processor=processor,
                                 trained_only=trained_only)
        if self.token_budget:  # rows back in their original order and [rows, seq] places
            full = self._from_last_stage(assemble(batch, micro, outputs) if outputs else None)
            if self.layout.dp > 1:  # each row was computed on one DP rank, zeros elsewhere
                dist.all_reduce(full, group=ps.get_data_parallel_group())
            return full
        shard = self._from_last_stage(torch.cat(outputs) if outputs else None)
        gathered = [torch.empty_like(shard) for _ in range(self.layout.dp)]
        dist.all_gather(gathered, shard.contiguous(), group=ps.get_data_parallel_group())
        return torch.cat(gathered)

    def _forward_backward(self, batch: TokenBatch, loss_fn: LossFn, forward_only: bool
                          ) -> dict[str, float]:
        micro = self._micro_batches(batch)

        def loss_func(mb: TokenBatch, out: torch.Tensor):
            mb, out = loss_inputs(mb, out)  # a packed micro-batch as one sequence per row
            res = loss_fn(out[..., 0], out[..., 1], mb)
            tokens = res.num_tokens.to(torch.int)
            reported = {k: v.detach().float() for k, v in res.metrics.items()}
            reported.update({TOKEN_MEAN + k: v.detach().float()
                             for k, v in res.token_metrics.items()})
            if res.token_metrics:
                reported[MASKED_TOKENS] = res.masked_tokens.float()
            reported["loss"] = res.loss_sum.detach().float()
            reported["num_tokens"] = tokens.float()
            return res.loss_sum, tokens, reported

        # only trained targets go through the output layer: the others carry no loss
        per_mb = self._schedule(micro, loss_func, forward_only=forward_only, collect=False,
                                trained_only=True)
        return self._reduce_metrics(per_mb)

    def _micro_batches(self, batch: TokenBatch) -> list[TokenBatch]:
        """This DP rank's micro-batches: fixed `micro_batch_size` rows of an equal row shard,
        or token-budget (optionally packed) micro-batches, as many on every DP rank."""
        if not self.token_budget:
            local = batch.shard(self.layout.dp_rank, self.layout.dp)
            return local.micro_batches(min(self.cfg.train.micro_batch_size, local.rows))
        return micro_batches(batch, dp=self.layout.dp, dp_rank=self.layout.dp_rank,
                             budget=self.token_budget, multiple=self.seq_multiple,
                             pack=self.pack, uniform=self.uniform_shapes,
                             share=self.share_prefixes)

    @contextlib.contextmanager
    def _model_inputs(self, mb: TokenBatch):
        """Keyword inputs of the model call for `mb`: a packed micro-batch's block-diagonal
        causal mask and restarting RoPE positions, the MoE padding mask; an empty (padding
        only) micro-batch adds no router load-balancing loss."""
        inputs: dict[str, Any] = {"attention_mask": None}
        if not isinstance(mb, MicroBatch):
            yield inputs
            return
        aux = getattr(self.config, "moe_aux_loss_coeff", None)
        if mb.packed:
            inputs["attention_mask"] = mb.attention_mask()
            self.rope.positions = mb.position_ids
        if self.moe_padding_mask and not mb.empty:
            inputs["padding_mask"] = ~mb.valid  # True = padding
        if mb.empty and self.spec.is_moe:  # (full activation recompute in backward would
            self.config.moe_aux_loss_coeff = 0.0  # re-add it over its `multiple` tokens)
        try:
            yield inputs
        finally:
            if self.spec.is_moe:
                self.config.moe_aux_loss_coeff = aux
            if self.rope is not None:
                self.rope.positions = None

    def _logprob_processor(self):
        return logprob_output_processor(self.spec.vocab_size, self.temperature,
                                        self.cfg.train.logprob_chunk_tokens,
                                        self.cfg.train.logits_matmul_dtype)

    def _schedule(self, micro: list[TokenBatch], loss_func, *, forward_only: bool,
                  collect: bool, processor=None, trained_only: bool = False) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        processor = processor or self._logprob_processor()

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            reroute = self.routing and self.routing.set(mb.extras.get(ROUTED_EXPERTS))
            with self._model_inputs(mb) as inputs:
                out = model(mb.input_ids, mb.position_ids, labels=mb.labels,
                            output_processor=partial(processor, keep=mb.loss_mask > 0)
                            if trained_only else processor, **inputs)
            if reroute and out.requires_grad:  # recomputation in backward routes the same way
                out.register_hook(reroute)
            return out, partial(loss_func, mb)

        t0 = time.perf_counter()
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro), model=self.model,
                num_microbatches=len(micro), seq_length=max(m.seq_length for m in micro),
                micro_batch_size=max(m.rows for m in micro), forward_only=forward_only,
                collect_non_loss_data=collect)
        finally:
            self.forward_backward_seconds += time.perf_counter() - t0
            if self.routing:
                self.routing.clear()

    def _from_last_stage(self, obj: Any) -> Any:
        """Share a value that only the last pipeline stage computed with all stages."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            return obj
        box = [obj]
        src = ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(box, src=src, group=ps.get_pipeline_model_parallel_group())
        return box[0]

    def _reduce_metrics(self, per_mb: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Token-weighted means over the whole global batch (all DP ranks, all micro-batches)."""
        from megatron.core import parallel_state as ps

        sums: dict[str, torch.Tensor] = {}
        for d in per_mb or []:
            for k, v in d.items():
                sums[k] = sums.get(k, 0) + v
        if sums:
            keys = sorted(sums)
            flat = torch.stack([sums[k].reshape(()) for k in keys]).double()
            dist.all_reduce(flat, group=ps.get_data_parallel_group())
            sums = dict(zip(keys, flat.tolist(), strict=True))
        sums = self._from_last_stage(sums)
        tokens = max(sums.pop("num_tokens", 0.0), 1.0)
        masked = max(sums.pop(MASKED_TOKENS, 0.0), 1.0)
        out = {k.removeprefix(TOKEN_MEAN): v / (masked if k.startswith(TOKEN_MEAN) else tokens)
               for k, v in sums.items()}
        out["num_tokens"] = tokens
        return out

    # -- colocated memory (trainer/offload.py) -------------------------------------------------
    def offload(self, release: bool | None = None) -> MoveStats:
        """Parameters, gradient buffers and optimizer state to host memory (a colocated
        engine takes the GPU); on CPU only counted unless `release`."""
        if not hasattr(self, "_offloader"):
            self._offloader = Offloader()
        return self._offloader.offload(self.model, self.optimizer, release)

    def onload(self) -> MoveStats:
        """Back onto the device, bit for bit, before the next forward."""
        return self._offloader.onload()

    def readable(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of this actor, readable also while offloaded (its host copy)."""
        return self._offloader.readable(t) if hasattr(self, "_offloader") else t

    @property
    def offloaded(self) -> bool:
        return hasattr(self, "_offloader") and self._offloader.offloaded

    # -- state -------------------------------------------------------------------------------
    def parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by Megatron name (no DDP prefix)."""
        return {name: p for name, p in self.model[0].module.named_parameters()}


def _gathered_logits(*, hidden_states, output_layer, output_weight, vocab: int, **_unused):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    logits, _ = output_layer(hidden_states, weight=output_weight)
    logits = gather_from_tensor_model_parallel_region(logits)  # [s, b, V_padded]
    return logits[..., :vocab].transpose(0, 1).float().contiguous()


def _skip_non_finite(optimizer) -> None:
    """Make a step whose gradient norm is NaN or inf change nothing and report `ok=False`.

    Megatron's fp32 optimizer would clip by a NaN coefficient (a no-op) and let Adam write NaN
    into every weight. The norm is the one the step computes anyway, reduced over every rank
    that holds a share of the model, so all ranks skip together (verl skips such a step too).
    """
    norm_of, update = optimizer.get_grad_norm, optimizer.step_with_ready_grads
    finite = True

    def get_grad_norm():
        nonlocal finite
        norm = norm_of()
        finite = math.isfinite(norm)
        if not finite:
            logger.warning("gradient norm %s: the optimizer step is skipped", float(norm))
        return norm

    def step_with_ready_grads() -> bool:
        return update() if finite else False

    optimizer.get_grad_norm, optimizer.step_with_ready_grads = get_grad_norm, step_with_ready_grads


def _foreach(optimizer: torch.optim.Optimizer) -> None:
    """torch's Adam(W), megatron's optimizer without TE or apex (on CPU), loops over its
    tensors in Python off CUDA, six ops a tensor; its for-each form is the same update bit for
    bit (tests/test_checkpoint.py) in a few kernels over all of them. Where a group has
    no choice of its own."""
    for group in optimizer.param_groups:
        if group.get("foreach") is None:
            group["foreach"] = True
