"""`megatron-rl train RECIPE [overrides]`: the RL loop, top-down.

rollout (agent × engine × tools) → judge → group advantages → Megatron update → weight sync.

The driver process owns the rollout side: the generated world and its search index (the
embedded default), the engine, the agent, the judge and the scheduler. The trainer ranks (a
local gloo worker pool, or torchrun) own the Megatron actor (`trainer/remote.py`) and push their
weights into the engine after every update, stamped with the step as the weight version.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from megatron_rl.config.schema import Config


def _prompts(cfg: Config, folder: Path):
    """The embedded default's questions over its generated world, cycled; and the index."""
    from megatron_rl.data.world import build_world_index, generate_world
    from megatron_rl.rollout.scheduler import Prompt

    world = generate_world(num_docs=cfg.rl.world_docs, seed=cfg.train.seed)
    where = folder / f"world-{cfg.rl.world_docs}-{cfg.train.seed}"  # deterministic: reusable
    index = where / "index" if (where / "index").is_dir() else build_world_index(world, where)
    questions = world.questions(64, seed=cfg.train.seed)

    def cycle():
        for epoch in range(1 << 30):
            for i, q in enumerate(questions):
                yield Prompt(q.question, q.answer, f"q{i}.e{epoch}")
    return cycle(), index


def _agent(cfg: Config, tokenizer: Any, index: Path):
    from megatron_rl.agents import AgentConfig, IterSynthAgent, ReActAgent
    from megatron_rl.env.search import LocalSearch
    from megatron_rl.env.visit import LocalPages, Visit
    from megatron_rl.rollout.engines.base import SamplingParams

    rl = cfg.rl
    config = AgentConfig(max_turns=rl.max_turns, max_context_tokens=cfg.model.seq_length,
                         sampling=SamplingParams(temperature=rl.temperature,
                                                 max_new_tokens=rl.max_new_tokens))
    cls = {"react": ReActAgent, "itersynth": IterSynthAgent}[rl.agent]
    return cls(tokenizer, [LocalSearch(index), Visit(LocalPages(index))], config)


def _batch(rollouts: Any, cfg: Config, rows_multiple: int):
    from megatron_rl.algorithms.advantages import trajectory_advantages
    from megatron_rl.algorithms.rdpo import token_advantages
    from megatron_rl.rollout.batching import build_batch

    trajs = rollouts.trajectories
    adv = trajectory_advantages(trajs, estimator=cfg.rl.estimator)
    seqs, per_token = [], []
    for traj, a, trained in zip(trajs, adv.advantages, adv.in_loss, strict=True):
        for seq in traj.sequences():
            seqs.append(seq)
            per_token.append(token_advantages([seq], [a if trained else None] *
                                              len(traj.turns))[0])
    if not seqs:  # e.g. every prompt overflowed the context: nothing was generated
        return None, adv.metrics
    return build_batch(seqs, per_token, seq_length=cfg.model.seq_length, pad_id=0,
                       rows_multiple=rows_multiple), adv.metrics


async def _collect(scheduler: Any, engine: Any, step: int) -> Any:
    try:
        return await scheduler.collect(step)
    finally:
        await engine.close()  # its HTTP session belongs to this step's event loop


def train(cfg: Config, pool: Any) -> list[dict[str, Any]]:
    """The loop; `pool.run(fn, *args)` runs `fn` on every trainer rank."""
    import transformers

    from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
    from megatron_rl.models.registry import get_model_spec
    from megatron_rl.rewards.rule import RuleJudge
    from megatron_rl.rewards.taxonomy import taxonomy_metrics
    from megatron_rl.rollout.engines.embedded import EmbeddedServer
    from megatron_rl.rollout.engines.http_client import HttpEngine
    from megatron_rl.rollout.scheduler import RolloutScheduler, SchedulerConfig
    from megatron_rl.trainer import remote
    from megatron_rl.utils.metrics import MetricsLogger

    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = get_model_spec(cfg.model.name)
    tokenizer = tiny_qwen3_tokenizer(vocab_size=spec.vocab_size)
    prompts, index = _prompts(cfg, out)
    info = pool.run(remote.init, cfg)[0]
    start = int(info["progress"].get("step", 0))
    # the engine starts from random weights of the same architecture; the first sync
    # (version = the step) replaces them with the trainer's
    engine_model = transformers.AutoModelForCausalLM.from_config(spec.hf_config())
    server = EmbeddedServer(engine_model, tokenizer).start()
    pool.run(remote.connect, [server.url])
    pool.run(remote.sync, start)
    engine = HttpEngine(server.url)
    scheduler = RolloutScheduler(
        _agent(cfg, tokenizer, index), engine, RuleJudge(), prompts,
        SchedulerConfig(samples_per_prompt=cfg.rl.samples_per_prompt,
                        groups_per_step=cfg.rl.groups_per_step, oversample=cfg.rl.oversample,
                        dynamic_sampling=cfg.rl.dynamic_sampling))
    for _ in range(int(info["progress"].get("prompts_started", 0))):  # the data cursor
        next(prompts)
    scheduler.started = int(info["progress"].get("prompts_started", 0))
    logger = MetricsLogger(out, resume=start > 0)
    if start == 0:
        (out / "trajectories.jsonl").unlink(missing_ok=True)
    rows = []
    try:
        for step in range(start, cfg.train.steps):
            t0 = time.perf_counter()
            rollouts = asyncio.run(_collect(scheduler, engine, step))
            t1 = time.perf_counter()
            batch, adv_metrics = _batch(rollouts, cfg, info["dp"] * cfg.train.micro_batch_size)
            metrics = pool.run(remote.update, batch)[0] if batch else {"skipped": 1.0}
            t2 = time.perf_counter()
            metrics.update(pool.run(remote.sync, step + 1)[0])
            t3 = time.perf_counter()
            trajs = rollouts.trajectories
            metrics.update(**rollouts.metrics, **adv_metrics, **taxonomy_metrics(trajs),
                           **{"time/rollout": t1 - t0, "time/train": t2 - t1,
                              "time/sync": t3 - t2,
                              "batch/sequences": float(batch.rows if batch else 0)})
            with (out / "trajectories.jsonl").open("a") as f:
                for t in trajs:
                    f.write(json.dumps({"step": step, **t.to_dict()}) + "\n")
            logger.log(step + 1, metrics,
                       console_keys=("reward/outcome_mean", "rollout/pass_rate", "loss",
                                     "grad_norm", "time/rollout"))
            rows.append(metrics)
            if cfg.checkpoint.dir and cfg.checkpoint.save_every and \
                    (step + 1) % cfg.checkpoint.save_every == 0:
                pool.run(remote.save, {"prompts_started": scheduler.started})
        logger.plot(("reward/outcome_mean", "loss", "grad_norm"), "rl_curves.png")
    finally:
        pool.run(remote.close)
        server.stop()
    return rows
