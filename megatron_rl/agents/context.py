"""Inference-time context management, for evaluation only.

- `discard_all` (ReAct): when the next context could not hold a full response, drop the whole
  history and continue from the first prompt (the question); the turn and tool-call counts
  carry on. Counted in `metadata["discards"]`.
- `retry`: an episode that ends without an answer is restarted, up to N times; the last
  attempt is returned, earlier attempts' statuses in `metadata["failed_attempts"]`.

Both are off during training: a trajectory must show the policy's own failures (an
`overlong` or a missing answer), not a rescued run.
"""

from __future__ import annotations

import copy
import dataclasses

from megatron_rl.agents.base import Agent, BaseAgent, Messages
from megatron_rl.engines.base import RolloutEngine
from megatron_rl.records.trajectory import Trajectory


class RetryAgent:
    """Restarts an episode that ended without an answer (each attempt has its own request ids)."""

    def __init__(self, agent: Agent, retries: int):
        if retries < 0:
            raise ValueError(f"retries={retries} must be >= 0")
        self.agent, self.retries = agent, retries

    async def run(self, question: str, reference: str | None, engine: RolloutEngine, *,
                  group_id: str, uid: str, messages: Messages | None = None) -> Trajectory:
        failed: list[str] = []
        chat = {"messages": messages} if messages else {}  # agents without `messages` still work
        for attempt in range(self.retries + 1):
            traj = await self.agent.run(question, reference, engine, group_id=group_id,
                                        uid=f"{uid}~{attempt}" if attempt else uid, **chat)
            traj.uid = uid
            if traj.answer is not None or attempt == self.retries:
                break
            failed.append(traj.status if traj.labels else "no_answer")
        traj.metadata.update(attempts=attempt + 1, failed_attempts=failed)
        return traj


def for_eval(agent: BaseAgent, *, discard_all: bool = True, retries: int = 0) -> Agent:
    """The same agent with eval-time context management on (the original is left as is)."""
    agent = copy.copy(agent)
    agent.config = dataclasses.replace(agent.config, discard_all=discard_all)
    return RetryAgent(agent, retries) if retries else agent
