"""Collecting a step's rollout groups: every prompt is run `samples_per_prompt` times (a GRPO
group), each finished group is judged at once, and with dynamic sampling (DAPO) groups whose
rewards all agree are dropped and replaced by prompts over-sampled up front. Once enough groups
are kept, the sessions still running are cancelled; their prompts go back to the front of the
queue for the next step (the simple, synchronous form of Iris' partial rollout).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.algorithms.advantages import dynamic_sampling_filter, trajectory_flags
from megatron_rl.rewards.composite import score_group
from megatron_rl.rollout.engines.base import RolloutEngine
from megatron_rl.rollout.trajectory import Trajectory


@dataclass
class Prompt:
    question: str
    answer: str
    uid: str                       # stable id of the prompt (the group id of its samples)


@dataclass
class SchedulerConfig:
    samples_per_prompt: int = 4
    groups_per_step: int = 2
    oversample: float = 1.0        # prompts started per needed group (Iris uses ~2)
    dynamic_sampling: bool = True  # drop zero-variance groups and refill
    max_refills: int = 4           # rounds of refill before a step gives up filling

    def __post_init__(self) -> None:
        if self.samples_per_prompt < 1 or self.groups_per_step < 1:
            raise ValueError("samples_per_prompt and groups_per_step must be >= 1")
        if self.oversample < 1.0:
            raise ValueError(f"oversample={self.oversample} must be >= 1")


@dataclass
class StepRollouts:
    groups: list[list[Trajectory]]
    dropped_groups: int = 0        # zero-variance (or all-excluded) groups
    cancelled_prompts: int = 0     # still running when the step had enough; requeued
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g]


class RolloutScheduler:
    """Feeds prompts to an agent, a group at a time, until a step has its groups."""

    def __init__(self, agent: Any, engine: RolloutEngine, judge: Any,
                 prompts: Iterator[Prompt], config: SchedulerConfig | None = None):
        self.agent, self.engine, self.judge = agent, engine, judge
        self.prompts, self.cfg = prompts, config or SchedulerConfig()
        self.requeued: deque[Prompt] = deque()  # cancelled last step: first in line
        self.started = 0                        # prompts drawn from `prompts` so far

    def _next_prompt(self) -> Prompt | None:
        if self.requeued:
            return self.requeued.popleft()
        prompt = next(self.prompts, None)
        self.started += prompt is not None
        return prompt

    async def _group(self, prompt: Prompt, step: int) -> list[Trajectory]:
        n = self.cfg.samples_per_prompt
        trajs = await asyncio.gather(*(self.agent.run(
            prompt.question, prompt.answer, self.engine, group_id=prompt.uid,
            uid=f"{prompt.uid}/s{step}/{i}") for i in range(n)))
        await score_group(list(trajs), self.judge)
        return list(trajs)

    def _keep(self, group: list[Trajectory]) -> bool:
        if not self.cfg.dynamic_sampling:
            return True
        in_stats, _ = trajectory_flags(group)
        rewards = [t.rewards.get("outcome", 0.0) for t in group]
        return not dynamic_sampling_filter(rewards, [0] * len(group), in_stats).num_dropped

    async def collect(self, step: int) -> StepRollouts:
        need = self.cfg.groups_per_step
        out = StepRollouts([])
        running: dict[asyncio.Task, Prompt] = {}

        def launch(count: int) -> None:
            for _ in range(count):
                prompt = self._next_prompt()
                if prompt is None:
                    return
                running[asyncio.create_task(self._group(prompt, step))] = prompt

        launch(math.ceil(need * self.cfg.oversample))
        refills = 0
        while running and len(out.groups) < need:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                running.pop(task)
                group = task.result()
                if len(out.groups) < need and self._keep(group):
                    out.groups.append(group)
                elif len(out.groups) < need:
                    out.dropped_groups += 1
                    if refills < self.cfg.max_refills * need:
                        refills += 1
                        launch(1)
        for task, prompt in running.items():  # enough groups: the rest waits for next step
            task.cancel()
            self.requeued.append(prompt)
            out.cancelled_prompts += 1
        await asyncio.gather(*running, return_exceptions=True)
        out.metrics = {"rollout/groups": len(out.groups),
                       "rollout/dropped_groups": out.dropped_groups,
                       "rollout/cancelled_prompts": out.cancelled_prompts}
        return out
