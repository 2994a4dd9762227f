"""Collecting a step's rollout groups: every prompt is run `samples_per_prompt` times (a GRPO
group), each finished group is judged at once, and with dynamic sampling (DAPO) groups whose
rewards all agree are dropped and replaced by prompts over-sampled up front. Once enough groups
are kept, the sessions still running are cancelled and their groups go back to the front of the
queue for the next step. Without partial rollout they start over; with it (Iris), every
session resumes from its last committed message, kept in the rollout forest (`forest.py`), so
the long tail of a step is not thrown away but finished under the next weights.

With `skip_settled` (GRESO), a prompt whose last group was dropped is skipped, with that
chance, when the cycle brings it round again: once the policy always (or never) solves a
question, its groups would only be dropped and refilled. Whether a given draw is skipped
depends only on the question's key and the draw count, so a resumed run skips the same ones.

Kept groups are returned in launch order (not completion order), so a run whose groups are all
kept (no over-sampling, no dynamic sampling) builds the same batch whatever the timing.

The cut leaves nothing on the engine: a cancelled session's request in flight is not dropped
with its connection but aborted on the engine (`RolloutEngine.abort`), and the step waits for
its answer (finish reason 'abort', thrown away), so once `collect` returns every request the
step sent has been answered. Dropping the call instead leaves a race: a request that reaches
the engine after its own abort decodes on unseen, and can still hold its rid when the resumed
session asks again.
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_rl.algorithms.advantages import dynamic_sampling_filter, trajectory_flags
from megatron_rl.config.schema import SchedulerConfig
from megatron_rl.engines.base import GenerateRequest, GenerateResult, RolloutEngine
from megatron_rl.env.base import row_arguments
from megatron_rl.records.prompt import Prompt
from megatron_rl.records.trajectory import Trajectory
from megatron_rl.rollout.forest import RolloutForest


@dataclass
class StepRollouts:
    groups: list[list[Trajectory]]
    dropped_groups: int = 0        # zero-variance (or all-excluded) groups
    # dropped groups kept for some roles' turns (`dropped_group_roles`), after `groups`
    role_groups: list[list[Trajectory]] = field(default_factory=list)
    cancelled_prompts: int = 0     # still running when the step had enough; requeued
    # finished together with the last needed group (one wake-up of the loop): not trained
    surplus_groups: int = 0
    skipped_prompts: int = 0       # settled prompts passed over (`skip_settled`)
    resumed_samples: int = 0       # sessions continued from a committed prefix
    judge_seconds: float = 0.0     # summed over groups (they are judged concurrently)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups + self.role_groups for t in g]


@dataclass
class PendingGroup:
    """A prompt's group: per sample, its forest node (the root until a message commits)."""

    prompt: Prompt
    nodes: list[int]
    order: int = 0                 # launch order, which orders a step's kept groups


class StepRequests:
    """One step's view of the engine, given to its sessions: each `generate` runs as a task of
    its own, so a session the cut cancels leaves its request to `cut`, which aborts it on the
    engine and waits for its answer. Every other attribute is the engine's."""

    # after each round of aborts, how long `cut` waits for the aborted requests' answers
    # before aborting them again (one that reached the engine after its abort was not found);
    # after the last, the calls are cancelled (an engine whose abort ends nothing)
    ABORT_WAITS_S = (0.005, 0.02, 0.08)

    def __init__(self, engine: Any):
        self.engine = engine
        self.running: dict[asyncio.Task, str] = {}  # the calls under way → their rids

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        # started now, not after every other session's turn of the loop: an in-process
        # engine gets the step's first request while the others are still being built
        task = asyncio.Task(self.engine.generate(req), loop=asyncio.get_running_loop(),
                            eager_start=True)
        self.running[task] = req.rid
        task.add_done_callback(lambda t: self.running.pop(t, None))
        return await asyncio.shield(task)  # a cancelled session leaves the call to `cut`

    async def cut(self) -> None:
        """Abort the calls still running (their sessions are gone) and wait for their answers;
        a call its engine does not end on abort is cancelled (the client drops it)."""
        rids = {t: rid for t, rid in self.running.items() if not t.done()}
        left = list(rids)
        for wait_s in self.ABORT_WAITS_S:
            if not left:
                return
            await asyncio.gather(*(self.engine.abort(rids[t]) for t in left),
                                 return_exceptions=True)
            _, pending = await asyncio.wait(left, timeout=wait_s)
            left = list(pending)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    def drop(self) -> None:
        """Cancel every call under way (the client drops them: `HttpEngine` aborts each)."""
        for task in list(self.running):
            task.cancel()


class RolloutScheduler:
    """Feeds prompts to an agent, a group at a time, until a step has its groups."""

    def __init__(self, agent: Any, engine: RolloutEngine, prompts: Iterator[Prompt],
                 score: Callable[[list[Trajectory]], Awaitable[Any]],
                 config: SchedulerConfig | None = None):
        """`score(group)` writes the rewards of a finished group (the task's scorer, e.g.
        `rewards.composite.score_group` with its judge)."""
        self.agent, self.engine, self.score = agent, engine, score
        self.prompts, self.cfg = prompts, config or SchedulerConfig()
        self.requeued: deque[PendingGroup] = deque()  # cut last step: first in line
        self.started = 0                              # prompts drawn from `prompts` so far
        self.settled: set[str] = set()  # question keys whose last group was dropped
        self.skipped = 0                              # settled prompts passed over so far
        self.forest = RolloutForest()
        self._launched = 0

    def _skips(self, key: str) -> bool:
        """A settled question's coin for this draw: a function of its key and the draw count."""
        if key not in self.settled:
            return False
        coin = zlib.crc32(f"{key}#{self.started}".encode()) / 2**32
        return coin < self.cfg.skip_settled

    def _next_group(self) -> PendingGroup | None:
        if self.requeued:
            group = self.requeued.popleft()
        else:
            while True:
                prompt = next(self.prompts, None)
                if prompt is None:
                    return None
                self.started += 1
                if not self._skips(prompt.question_key):
                    break
                self.skipped += 1
            root = self.forest.root(prompt.uid)
            group = PendingGroup(prompt, [root] * self.cfg.samples_per_prompt)
        group.order, self._launched = self._launched, self._launched + 1
        return group

    async def _sample(self, group: PendingGroup, i: int, step: int, out: StepRollouts,
                      engine: StepRequests) -> Trajectory:
        p = group.prompt
        resume = self.forest.resume(group.nodes[i])
        if resume is not None and resume[1].get("done"):  # finished before the cut
            return resume[0]
        out.resumed_samples += resume is not None

        def commit(traj: Trajectory, state: dict[str, Any]) -> None:
            group.nodes[i] = self.forest.commit(group.nodes[i], traj, state)

        keep = self.cfg.partial_rollout  # without it a cut session starts over: keep nothing
        with row_arguments(p.metadata.get("tool_arguments")):  # the row's tools_kwargs
            traj = await self.agent.run(p.question, p.answer, engine, group_id=p.uid,
                                        uid=f"{p.uid}/s{step}/{i}", resume=resume,
                                        commit=commit if keep else None,
                                        **({"messages": p.messages} if p.messages else {}))
        traj.metadata.update(p.metadata)
        if keep:
            commit(traj, {"done": True})
        return traj

    async def _group(self, group: PendingGroup, step: int, out: StepRollouts,
                     engine: StepRequests) -> list[Trajectory]:
        trajs = await asyncio.gather(*(self._sample(group, i, step, out, engine)
                                       for i in range(len(group.nodes))))
        t0 = time.perf_counter()
        await self.score(list(trajs))
        out.judge_seconds += time.perf_counter() - t0
        return list(trajs)

    @staticmethod
    def _outcomes_differ(group: list[Trajectory]) -> bool | None:
        """Whether the outcomes DAPO's filter counts differ; None with fewer than two of them
        (an env failure is not the policy's answer: such a group settles nothing)."""
        in_stats, _ = trajectory_flags(group)
        if sum(in_stats) < 2:
            return None
        rewards = [t.rewards.get("outcome", 0.0) for t in group]
        return not dynamic_sampling_filter(rewards, [0] * len(group), in_stats).num_dropped

    async def collect(self, step: int) -> StepRollouts:
        need = self.cfg.groups_per_step
        out, skipped = StepRollouts([]), self.skipped
        kept: list[tuple[int, list[Trajectory]]] = []
        for_roles: list[tuple[int, list[Trajectory]]] = []  # dropped, trained for some roles
        roles = list(self.cfg.dropped_group_roles) if self.cfg.dynamic_sampling else []
        sampled: list[float] = []  # the outcomes of every group that finished
        running: dict[asyncio.Task, PendingGroup] = {}
        engine = StepRequests(self.engine)

        def launch(count: int) -> None:
            for _ in range(count):
                group = self._next_group()
                if group is None:
                    return
                running[asyncio.create_task(self._group(group, step, out, engine))] = group

        try:
            launch(math.ceil(need * self.cfg.oversample))
            refills = 0
            while running and len(kept) < need:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: running[t].order):
                    group = running.pop(task)
                    self.forest.release(group.prompt.uid)
                    trajs = task.result()
                    sampled += [t.rewards.get("outcome", 0.0) for t in trajs]
                    differ = self._outcomes_differ(trajs)
                    if differ is not None:
                        (self.settled.discard if differ else self.settled.add)(
                            group.prompt.question_key)
                    if len(kept) >= need:
                        out.surplus_groups += 1
                    elif differ or not self.cfg.dynamic_sampling:
                        kept.append((group.order, trajs))
                    else:
                        out.dropped_groups += 1
                        if roles and len(for_roles) < need:
                            for t in trajs:  # the other roles' turns leave the loss
                                t.metadata["trained_roles"] = roles
                            for_roles.append((group.order, trajs))
                        if refills < self.cfg.max_refills * need:
                            refills += 1
                            launch(1)
            for task in running:  # enough groups: the rest waits for the next step
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await engine.cut()  # their requests still on the engine: aborted and answered
        except BaseException:  # a failed session or a cancelled collect: drop everything
            for task in running:
                task.cancel()
            engine.drop()
            raise
        for group in sorted(running.values(), key=lambda g: g.order):
            if not self.cfg.partial_rollout:  # start over: forget the committed prefixes
                self.forest.release(group.prompt.uid)
                group.nodes = [self.forest.root(group.prompt.uid)] * len(group.nodes)
            self.requeued.append(group)
            out.cancelled_prompts += 1
        out.skipped_prompts = self.skipped - skipped
        out.groups = [trajs for _, trajs in sorted(kept, key=lambda x: x[0])]
        out.role_groups = [trajs for _, trajs in sorted(for_roles, key=lambda x: x[0])]
        out.metrics = {"rollout/groups": len(out.groups),
                       **({"rollout/role_groups": len(out.role_groups)} if roles else {}),
                       "rollout/dropped_groups": out.dropped_groups,
                       "rollout/cancelled_prompts": out.cancelled_prompts,
                       "rollout/surplus_groups": out.surplus_groups,
                       "rollout/skipped_prompts": out.skipped_prompts,
                       "rollout/resumed_samples": out.resumed_samples,
                       "time/judge": out.judge_seconds,
                       # every finished group's, dropped ones too: the policy's own rate
                       "rollout/sampled_outcome_mean": sum(sampled) / max(len(sampled), 1),
                       **self.forest.metrics}
        return out

    # -- checkpointing: the data cursor, the requeued groups and their committed prefixes ------
    def state_dict(self) -> dict[str, Any]:
        return {"started": self.started, "launched": self._launched,
                "requeued": [{"prompt": asdict(g.prompt), "nodes": list(g.nodes)}
                             for g in self.requeued],
                "forest": self.forest.state_dict(), "settled": sorted(self.settled)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; `prompts` must be a fresh iterator: the data cursor is
        advanced past the `started` prompts here."""
        for _ in range(int(state["started"]) - self.started):
            if next(self.prompts, None) is None:
                raise ValueError(f"the prompt source has fewer than {state['started']} prompts "
                                 "the checkpoint had started")
        self.started, self._launched = int(state["started"]), int(state.get("launched", 0))
        self.forest.load_state_dict(state["forest"])
        self.settled = set(state.get("settled", ()))
        self.requeued = deque(PendingGroup(Prompt(**g["prompt"]), list(g["nodes"]))
                              for g in state["requeued"])
