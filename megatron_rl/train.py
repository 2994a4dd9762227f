"""`megatron-rl train RECIPE [overrides]`: the RL loop, top-down.

rollout (agent × engine × tools) → judge → reward shaping → per-turn advantages → Megatron
update (PPO mini-batches) → weight sync. With `rl.sampling.one_step_off_policy` the next
step's rollouts are collected while the update runs (on a thread), from the weights before it.

The driver process owns the rollout side: the task (prompts, agent, judge; the generated world
and its search index by default), the engines and the scheduler with its rollout forest, all in
one event loop for the life of the run. The trainer ranks (a local worker pool, torchrun, or
Ray actors on any node: rollout.trainer_launcher=ray) each keep a `TrainerWorker` and push
their weights into the engines after every update, stamped with the step as the weight
version. A checkpoint holds both sides: the actor's model,
optimizer and RNG, and the driver's data cursor, requeued groups, forest and entropy
controller, so a killed run resumes where its last checkpoint was.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from megatron_rl.agents.tokenizer import pad_id, run_tokenizer
from megatron_rl.algorithms.entropy import EntropyPIController
from megatron_rl.algorithms.reward_managers import needs
from megatron_rl.config.schema import Config
from megatron_rl.data.parquet import read_prompts
from megatron_rl.distributed.spmd import RankObjects, SPMDGroup
from megatron_rl.engines.launch import Engines, start_engines
from megatron_rl.env.build import BUILTIN_PARAMETERS
from megatron_rl.evaluation import evaluate_prompts
from megatron_rl.models.registry import model_spec
from megatron_rl.rewards.shaping import shape_rewards
from megatron_rl.rewards.taxonomy import taxonomy_metrics
from megatron_rl.rollout.scheduler import RolloutScheduler, StepRollouts
from megatron_rl.tasks import build_task
from megatron_rl.trainer.batching import rl_batch
from megatron_rl.trainer.hf_weights import (
    checkpoint_due,
    export_step,
    initial_weights,
    save_run_tokenizer,
)
from megatron_rl.trainer.worker import TrainerWorker
from megatron_rl.utils.event_loop import Runner
from megatron_rl.utils.metrics import MetricsLogger, truncate_jsonl

CONSOLE = ("reward/outcome_mean", "rollout/pass_rate", "loss", "grad_norm", "entropy",
           "time/rollout", "eval/pass_rate")
CURVES = ("reward/outcome_mean", "rollout/pass_rate", "eval/outcome_mean", "loss", "grad_norm",
          "entropy", "mismatch/train_rollout_logprob_abs_diff", "rollout/turns_mean",
          "time/step")


def _dump(path: Path, step: int, trajectories: list[Any]) -> None:
    """The trajectories step `step` (1-based, as in metrics.jsonl) trained on, as JSONL
    (routing left out: it is per token per layer)."""
    with path.open("a") as f:
        for t in trajectories:
            row = t.to_dict()
            for turn in row["turns"]:
                turn.pop("routed_experts", None)
            f.write(json.dumps({"step": step, **row}) + "\n")


def _timed(times: dict[str, float], key: str, call: Any, *args: Any) -> Any:
    """`call(*args)`'s rank-0 result, as a thunk that records its seconds under `key`."""
    def run() -> dict[str, Any]:
        t = time.perf_counter()
        try:
            return _slowest(call(*args))
        finally:
            times[key] = time.perf_counter() - t
    return run


def _sync(trainer: RankObjects, engines: Engines, version: int, hold: bool) -> list[Any]:
    """The ranks push their weights as `version`. `hold`: they write the in-process engine's
    parameters in place, so this process holds it around the writes and commits the version
    after them: no begin and commit round trips through its HTTP server, no rendezvous of
    the ranks (the tiny run's sync: ~4 ms -> ~1 ms)."""
    if not hold:
        return trainer.call("sync", version)
    with engines.core.weights_held(version) as segment:
        return trainer.call("sync", version, [segment])


def _slowest(per_rank: list[Any]) -> Any:
    """Rank 0's metrics with each `time/` entry the slowest rank's: the step waits for it (DP
    ranks train on different token counts)."""
    first = per_rank[0]
    if not isinstance(first, dict):
        return first
    rows = [r for r in per_rank if isinstance(r, dict)]
    return {**first, **{k: max(r.get(k, v) for r in rows) for k, v in first.items()
                        if k.startswith("time/")}}


async def _collect(scheduler: RolloutScheduler, step: int, engines: Engines
                   ) -> StepRollouts:
    """Step `step`'s rollouts, with the seconds they took (`time/generate`: the in-process
    engine's share)."""
    t0, busy = time.perf_counter(), engines.busy_seconds()
    rollouts = await scheduler.collect(step)
    rollouts.metrics["time/rollout"] = time.perf_counter() - t0
    if busy is not None:
        rollouts.metrics["time/generate"] = engines.busy_seconds() - busy
    return rollouts


async def _alongside[T](work: Callable[[], T], collect: Awaitable[Any]) -> tuple[T, Any]:
    """`work()` on a thread (at this thread's torch thread count) while `collect` runs on the
    loop: one-step off-policy's update beside the next step's rollouts. A failed update
    cancels the collect."""
    task, threads = asyncio.ensure_future(collect), torch.get_num_threads()

    def on_thread() -> T:
        torch.set_num_threads(threads)  # OpenMP's count is per thread (torchrun's rank 0)
        return work()

    try:
        done = await asyncio.to_thread(on_thread)
    except BaseException:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    return done, await task


def _version_lag(trajs: list[Any], version: int) -> float:
    """How many weight versions the oldest token of the step's rollouts lags the trainer's
    (0 on policy; 1 one step off-policy; more for a resumed partial rollout)."""
    versions = [v for t in trajs for turn in t.turns for v in turn.weight_versions]
    return float(version - min(versions)) if versions else 0.0


def check_inputs(cfg: Config) -> None:
    """What a user brings, checked before any rank or engine starts (`megatron-rl train` makes
    each problem one line): the tokenizer against the model's embedding, and every row of the
    data files, their `tools_kwargs` against the tools' schemas when the tools are built-in
    (a plugin tool's are checked when the task builds it)."""
    run_tokenizer(cfg.model.hf_path, cfg.model.name, model_spec(cfg.model).vocab_size)
    data = cfg.data
    tools = {t: BUILTIN_PARAMETERS[t] for t in cfg.rl.tools} \
        if set(cfg.rl.tools) <= set(BUILTIN_PARAMETERS) else None
    for files, curriculum in ((data.train_files, data.curriculum), (data.val_files, "none")):
        if files:
            read_prompts(files, tool_parameters=tools, curriculum=curriculum)


def train(cfg: Config, group: SPMDGroup) -> list[dict[str, Any]]:
    """The loop; `group.run(fn, *args)` runs `fn` on every trainer rank."""
    rl, out = cfg.rl, Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = model_spec(cfg.model)
    tokenizer = run_tokenizer(cfg.model.hf_path, cfg.model.name, spec.vocab_size)
    rows = []
    with Runner() as loop, contextlib.ExitStack() as cleanup:  # unwinds backwards
        trainer = RankObjects(group, TrainerWorker, cfg, initial_weights(cfg, spec))
        cleanup.callback(trainer.close)
        info = trainer.call("describe")[0]
        progress, start = info["progress"], int(info["progress"].get("step", 0))
        # Ray trainer ranks hold the run's placement: the engines go in the same one
        engines = start_engines(cfg, spec, tokenizer, getattr(group, "placement", None))
        cleanup.callback(engines.stop)
        if cfg.rollout.ray:  # where the engines landed (their servers bind the node IP)
            print(f"[megatron-rl] policy engines: {' '.join(engines.urls)}", flush=True)
        cleanup.callback(loop.run, engines.aclose())
        task = build_task(cfg, tokenizer, out, engines.aux_urls)
        cleanup.callback(loop.run, task.aclose())
        hold = all(trainer.call("connect", engines.urls)) and engines.core is not None
        _sync(trainer, engines, start, hold)
        colocated = engines.schedule is not None and engines.schedule.enabled
        if colocated:  # the engines have the GPUs for the first rollout
            trainer.call("offload")
        scheduler = RolloutScheduler(task.agent, engines.policy, task.prompts, task.score,
                                     rl.sampling)
        entropy = EntropyPIController.from_config(rl.entropy_control, rl.loss.entropy_coef) \
            if rl.entropy_control.target else None
        if progress.get("rollout"):
            scheduler.load_state_dict(progress["rollout"])
        if entropy and progress.get("entropy_control"):
            entropy.load_state_dict(progress["entropy_control"])
        coef = entropy.coef if entropy and entropy.coef is not None else rl.loss.entropy_coef
        logger = MetricsLogger(out, resume_from=start or None, sinks=rl.loggers)
        cleanup.callback(logger.close)
        truncate_jsonl(out / "trajectories.jsonl", start or None)
        ahead = None  # one_step_off_policy: the rollouts collected while the last step trained
        for step in range(start, cfg.train.steps):
            t0 = time.perf_counter()
            rollouts = ahead or loop.run(_collect(scheduler, step, engines))
            trajs = rollouts.trajectories
            metrics = {**rollouts.metrics, **taxonomy_metrics(trajs),
                       "rollout/weight_version_lag": _version_lag(trajs, step)}
            shape_rewards(trajs, needs=needs(rl.reward_manager),
                          overlong_budget=rl.max_turns * rl.max_new_tokens,
                          overlong_buffer=rl.overlong_buffer)
            batch, adv_metrics = rl_batch(trajs, rl, seq_length=cfg.model.seq_length,
                                          rows_multiple=info["dp"] * cfg.train.micro_batch_size,
                                          pad_id=pad_id(tokenizer),
                                          fit_multiple=info["seq_multiple"])
            metrics.update(adv_metrics)
            save, export = checkpoint_due(cfg.checkpoint, step + 1, cfg.train.steps)
            # taken before the next step's collect may move it: a resume collects that again
            progress = scheduler.state_dict() if save else None
            # colocated: engines release → trainer onload → update → trainer offload →
            # engine weights → sync → engine KV cache (engines/colocation.py)
            times: dict[str, float] = {}
            update = _timed(times, "train", trainer.call, "update", batch, coef)
            sync = _timed(times, "sync", _sync, trainer, engines, step + 1, hold)
            ahead = None
            if rl.sampling.one_step_off_policy and step + 1 < cfg.train.steps:
                updated, ahead = loop.run(_alongside(update, _collect(scheduler, step + 1,
                                                                      engines)))
                metrics.update({**updated, **sync()})
            else:
                metrics.update(engines.update_and_sync(
                    loop, update, sync,
                    onload=_timed(times, "onload", trainer.call, "onload") if colocated
                    else None,
                    offload=_timed(times, "offload", trainer.call, "offload") if colocated
                    else None))
            if entropy is not None and "entropy" in metrics:
                coef = entropy.update(metrics["entropy"])
            if rl.eval_every and (step + 1) % rl.eval_every == 0:
                metrics.update(loop.run(evaluate_prompts(
                    task.eval_agent, engines.policy, task.score, task.held_out)))
            _dump(out / "trajectories.jsonl", step + 1, trajs)  # inside the step's time
            metrics.update({"entropy_coef": coef, "time/train": times.get("train", 0.0),
                            "time/sync": times["sync"], "time/step": time.perf_counter() - t0,
                            "batch/sequences": float(batch.rows if batch else 0)})
            logger.log(step + 1, metrics, console_keys=CONSOLE)
            rows.append(metrics)
            if save:
                trainer.call("save", {
                    "rollout": progress,
                    "entropy_control": entropy.state_dict() if entropy else None})
            if export:
                export_step(cfg, spec, step + 1, Path(cfg.model.hf_path or
                                                      save_run_tokenizer(tokenizer, out)))
        logger.plot(CURVES, "rl_curves.png")
    return rows
