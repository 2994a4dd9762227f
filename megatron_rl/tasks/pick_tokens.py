"""`pick_tokens`: one message per prompt, rewarded with the share of its tokens that have an
even id. Any policy, even a random one, earns a reward with variance from the first step, so a
run shows within a few steps whether the loop learns (engine sampling → reward → update → sync
→ better samples), before a real task is worth its time. The agent is `rl.agent` (a recipe
sets `one_message`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.config.schema import Config
from megatron_rl.records.prompt import Prompt
from megatron_rl.rewards.sanity import score_even_tokens
from megatron_rl.tasks.base import Task, build_agents, cycle


def pick_tokens_task(cfg: Config, tokenizer: Any, folder: Path,
                     aux_urls: dict[str, list[str]]) -> Task:
    words = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
    n_eval = cfg.rl.eval_prompts if cfg.rl.eval_every else 0

    def prompt(word: str, uid: str) -> Prompt:
        return Prompt(f"Write about {word}.", "", uid)

    agent, eval_agent = build_agents(cfg, tokenizer, [])
    return Task(cycle(list(words), prompt),
                [prompt(f"{w} {i}", f"eval{i}") for i, w in enumerate(words[:n_eval])],
                agent, eval_agent, score_even_tokens)
