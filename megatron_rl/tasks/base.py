"""The task protocol and registry. A task factory `make(cfg, tokenizer, folder, aux_urls)`
returns a `Task`; a recipe names it in `rl.task` (registered name or import path)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.agents.base import AgentConfig
from megatron_rl.agents.registry import AGENTS
from megatron_rl.config.prompt_template import load_template
from megatron_rl.config.schema import Config
from megatron_rl.engines.base import SamplingParams
from megatron_rl.records.prompt import Prompt, epoch_uid
from megatron_rl.records.trajectory import Trajectory
from megatron_rl.utils.registry import Registry

Score = Callable[[list[Trajectory]], Awaitable[Any]]

TASKS = Registry("task", {
    "search": "megatron_rl.tasks.search:search_task",
    "pick_tokens": "megatron_rl.tasks.pick_tokens:pick_tokens_task",
})


@dataclass
class Task:
    prompts: Iterator[Prompt]  # cycled in a fixed order: the checkpoint's data cursor counts them
    held_out: list[Prompt]     # never in `prompts`
    agent: Any                 # samples at rl.temperature
    eval_agent: Any            # greedy
    score: Score               # writes the rewards of a finished group
    resources: list[Any] = field(default_factory=list)  # judges, tools: closed with the run

    async def aclose(self) -> None:
        """Close what holds a connection (their sessions live in the run's event loop)."""
        for obj in self.resources:
            close = getattr(obj, "close", None)
            if close is not None:
                await close()


def build_task(cfg: Config, tokenizer: Any, folder: Path,
               aux_urls: dict[str, list[str]] | None = None) -> Task:
    """The `rl.task`; with `data.prompt_template` its prompts (and held-out ones) start from
    that template's chat instead of the data's own or the agent's built-in prompt."""
    task = TASKS.get(cfg.rl.task, "rl.task")(cfg, tokenizer, folder, aux_urls or {})
    if cfg.data.prompt_template is not None:
        template = load_template(cfg.data.prompt_template)
        task.prompts = map(template.apply, task.prompts)
        task.held_out = [template.apply(p) for p in task.held_out]
    return task


def agent_config(cfg: Config, greedy: bool) -> AgentConfig:
    """The agent's config, every value from the recipe (`rl.agent_limits` as it is)."""
    rl = cfg.rl
    return AgentConfig(max_turns=rl.max_turns, max_context_tokens=cfg.model.seq_length,
                       sampling=SamplingParams(temperature=0.0 if greedy else rl.temperature,
                                               max_new_tokens=rl.max_new_tokens),
                       limits=rl.agent_limits, seed=cfg.train.seed,
                       return_routed_experts=rl.routing_replay, tool_specs=rl.tool_specs)


def build_agents(cfg: Config, tokenizer: Any, tools: Sequence[Any]) -> tuple[Any, Any]:
    """`rl.agent` sampling at `rl.temperature`, and its greedy twin for held-out eval."""
    cls = AGENTS.get(cfg.rl.agent, "rl.agent")
    return (cls(tokenizer, list(tools), agent_config(cfg, False)),
            cls(tokenizer, list(tools), agent_config(cfg, True)))


def cycle(items: list[Any], make: Callable[[Any, str], Prompt],
          key: Callable[[Any], str] | None = None) -> Iterator[Prompt]:
    """`make(item, uid)` for every item, epoch after epoch; the uid is the item's `key`
    (default `q<position>`) with the epoch (`epoch_uid`)."""
    for epoch in range(1 << 30):
        for i, item in enumerate(items):
            yield make(item, epoch_uid(key(item) if key else f"q{i}", epoch))
