"""`search` (the embedded default): the agent with local search and visit tools over the
generated world; the outcome judge (`rl.judge`, rule by default) and, when `rl.rubric` is set,
IterSynth's per-turn rubric scores (RDPO): an OpenAI-compatible judge, or `{kind: rule}` (rules
over the world question's known path, no model; `rewards/world_rubric.py`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from megatron_rl.config.schema import Config
from megatron_rl.data.parquet import read_prompts
from megatron_rl.data.world import build_world_index, generate_world
from megatron_rl.env.build import ToolContext
from megatron_rl.env.registry import TOOLS
from megatron_rl.records.prompt import Prompt
from megatron_rl.rewards.composite import build_judge, build_rubric, score_group
from megatron_rl.tasks.base import Task, build_agents, cycle

TRAIN_QUESTIONS = 64


def search_task(cfg: Config, tokenizer: Any, folder: Path,
                aux_urls: dict[str, list[str]]) -> Task:
    """The agent with `rl.tools` (backends from `env`), prompts from `data` (else the generated
    world's questions), the outcome judge `rl.judge` and the optional rubric judge."""
    rl = cfg.rl
    own_index = cfg.env.search.kind == "local" and cfg.env.search.index is None
    world = None
    if not cfg.data.train_files or own_index:  # the world's questions, or its pages
        world = generate_world(num_docs=rl.world_docs, seed=cfg.train.seed)
    index = None
    if world is not None:
        where = folder / f"world-{rl.world_docs}-{cfg.train.seed}"  # deterministic: reusable
        index = where / "index" if (where / "index").is_dir() else build_world_index(world,
                                                                                      where)
    ctx = ToolContext.open(cfg.env, index, aux_urls)
    tools = [TOOLS.get(name, f"rl.tools[{i}]")(ctx) for i, name in enumerate(rl.tools)]
    n_eval = rl.eval_prompts if rl.eval_every else 0
    if cfg.data.train_files:
        prompts, held_out = data_prompts(cfg, {t.name: t.parameters for t in tools}, n_eval)
    else:
        prompts, held_out = world_prompts(cfg, world, n_eval)
    agent, eval_agent = build_agents(cfg, tokenizer, tools)
    judge = build_judge(client_spec(rl.judge, aux_urls, "rl.judge") if rl.judge else None)
    rubric = build_rubric(client_spec(rl.rubric, aux_urls, "rl.rubric")) if rl.rubric else None
    return Task(prompts, held_out, agent, eval_agent,
                lambda group: score_group(group, judge, rubric),
                resources=[judge, *([rubric] if rubric else []), *tools])


def world_prompts(cfg: Config, world: Any, n_eval: int) -> tuple[Iterator[Prompt], list[Prompt]]:
    """The generated world's questions: the first `n_eval` distinct ones held out."""
    unique = list({q.question: q for q in world.questions(
        TRAIN_QUESTIONS + 4 * n_eval, seed=cfg.train.seed)}.values())
    if len(unique) <= n_eval:
        raise ValueError(f"rl.world_docs={cfg.rl.world_docs} yields {len(unique)} distinct "
                         f"questions: too few for rl.eval_prompts={n_eval} held out")
    held_out, train = unique[:n_eval], unique[n_eval:n_eval + TRAIN_QUESTIONS]

    def prompt(q: Any, uid: str) -> Prompt:  # the path: fact recall, the rule rubric
        return Prompt(q.question, q.answer, uid, metadata={"facts": list(q.facts),
                                                            "support": list(q.support)})

    return cycle(train, prompt), [prompt(q, f"eval{i}") for i, q in enumerate(held_out)]


def data_prompts(cfg: Config, tools: Mapping[str, Mapping[str, Any] | None], n_eval: int
                 ) -> tuple[Iterator[Prompt], list[Prompt]]:
    """`data.train_files` cycled epoch by epoch (uids `<file>:<index>.e<epoch>`), and the
    first `n_eval` rows of `data.val_files` held out. `tools`: the run's tools' argument
    schemas by name (rows' `tools_kwargs` are checked against them)."""
    data = cfg.data
    train = read_prompts(data.train_files, tool_parameters=tools, curriculum=data.curriculum)
    held_out = read_prompts(data.val_files, tool_parameters=tools)[:n_eval] \
        if data.val_files and n_eval else []
    return cycle(train, lambda p, uid: dataclasses.replace(p, uid=uid), key=lambda p: p.uid), \
        held_out


def client_spec(spec: dict[str, Any], aux_urls: dict[str, list[str]], where: str
                ) -> dict[str, Any]:
    """A judge spec whose `pool: NAME` is replaced by that aux pool's base URLs (Iris' in-cluster
    judge); other specs unchanged."""
    spec = dict(spec)
    pool = spec.pop("pool", None)
    if pool is None:
        return spec
    if pool not in aux_urls:
        raise ValueError(f"{where}.pool={pool!r}: no such rollout.aux_pools entry; started: "
                         f"{', '.join(aux_urls) or 'none'}")
    return {**spec, "base_url": aux_urls[pool]}
