"""ReAct: one growing conversation. think → tool call(s) → observation → … → `<answer>`.

Every turn's context is the previous turn's context + output + observation, so the whole
episode is one training sequence (`Trajectory.sequences()`), with only the policy's own tokens
trained. Episode ends: an answer; a message with no action; limits (`max_turns`,
`excess_tool_calls` past the episode budget, `overlong`), `degenerate` output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_rl.agents.base import AgentConfig, BaseAgent, Commit, Messages, Resume
from megatron_rl.engines.base import RolloutEngine
from megatron_rl.env.base import Tool
from megatron_rl.records.trajectory import Trajectory

REACT_SYSTEM_PROMPT = (
    "You are a deep-search assistant. Answer the user's question by searching the web and "
    "reading pages. Think step by step. Call tools whenever you need information; several "
    "calls in one message run in parallel. When you are confident, give the final answer, "
    "short and exact, inside <answer></answer>.")
FIRST_CONTEXTS = 256  # questions whose first context is kept (a step's groups, and more)


class ReActAgent(BaseAgent):
    role = "agent"

    def __init__(self, tokenizer: Any, tools: Sequence[Tool], config: AgentConfig, *,
                 system_prompt: str = REACT_SYSTEM_PROMPT):
        super().__init__(tokenizer, tools, config)
        self.system_prompt = system_prompt
        self._first: dict[str, list[int]] = {}  # question → its first context (a group's samples)

    def first_context(self, question: str, messages: Messages | None = None) -> list[int]:
        if messages:  # the data's chat (its system prompt, else ours)
            return self.chat.chat_ids(messages, self.system_prompt, self.specs)
        # every sample of a group renders and tokenizes the same prompt: once per question
        ids = self._first.get(question)
        if ids is None:
            ids = self.chat.prompt_ids(self.system_prompt, self.chat.safe_text(question),
                                       self.specs)
            if len(self._first) >= FIRST_CONTEXTS:
                del self._first[next(iter(self._first))]  # the oldest question
            self._first[question] = ids
        return list(ids)

    async def run(self, question: str, reference: str | None, engine: RolloutEngine, *,
                  group_id: str, uid: str, resume: Resume | None = None,
                  commit: Commit | None = None, messages: Messages | None = None
                  ) -> Trajectory:
        cfg = self.config
        traj, state = self.start(question, reference, group_id, uid, resume)
        first = self.first_context(question, messages)
        context = state.get("context", first)
        for step in range(state.get("step", 0), cfg.max_turns):
            msg = await self.message(engine, traj, context, self.role)
            acted = await self.act(traj, msg, step)
            if acted is None:
                break
            calls, within_budget = acted
            last = msg.turns[-1]
            last.observation_ids = self.chat.observation_ids(
                msg.output_ids, [c.observation for c in calls], cfg.limits.max_observation_tokens)
            if not within_budget:
                break
            context = last.context_ids + last.output_ids + last.observation_ids
            if cfg.discard_all and self.overflows(context):
                # eval-time context management: forget the history, keep the question
                traj.metadata["discards"] = traj.metadata.get("discards", 0) + 1
                context = first
            if commit is not None:
                commit(traj, {"step": step + 1, "context": context})
        return traj
