"""IterSynth: one shared policy in two roles, with a summary as the only state between steps.

Step t:
  Planner     sees (question, summary M_t) and the tools; it either calls search/visit tools
              or answers (`<answer>`).
  tools       run (concurrently); their observations are this step's evidence.
  Synthesizer sees (question, M_t, evidence), no tools; its output is M_{t+1}. Trying to call
              a tool or to answer is a `tool_parse_error` (M_t is then kept).
Every engine call starts from a fresh prompt, so each turn is its own training sequence; the
role (`planner` / `synthesizer`) is recorded on every turn. Contexts stay bounded by the
summary's length, so no context management is needed. `max_turns` counts planner steps.
Greedy, a Planner context seen before ends the episode (`repeated_state`): the steps would
repeat until the turn budget (`AgentConfig.stop_on_repeat`).

With the data's own chat (`messages`), every Planner context is that chat (its system prompt,
else the Planner's) with the notes appended to its last user turn; the Synthesizer keeps its own
prompt (the data's instructions are for the acting role).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from megatron_rl.agents.base import AgentConfig, BaseAgent, Commit, Message, Messages, Resume
from megatron_rl.engines.base import RolloutEngine
from megatron_rl.env.base import Tool
from megatron_rl.records.trajectory import ToolCall, Trajectory

PLANNER_PROMPT = (
    "You are the Planner of a deep-search team. You see the question and the notes gathered so "
    "far, never the raw pages. Decide the next step: call search or visit tools to gather the "
    "missing evidence (several calls run in parallel), or, when the notes settle the question, "
    "give the final answer, short and exact, inside <answer></answer>.")
SYNTHESIZER_PROMPT = (
    "You are the Synthesizer of a deep-search team. You see the question, the current notes and "
    "new evidence from tool calls. Rewrite the notes: keep every fact that helps answer the "
    "question (with its source URL), add what the new evidence establishes, drop the rest. "
    "Write only the new notes. Do not call tools and do not answer the question.")
NO_NOTES = "(no notes yet)"
QUESTION_LAST = "Question: "  # it ends the Synthesizer's context


class IterSynthAgent(BaseAgent):
    def __init__(self, tokenizer: Any, tools: Sequence[Tool], config: AgentConfig, *,
                 planner_prompt: str = PLANNER_PROMPT,
                 synthesizer_prompt: str = SYNTHESIZER_PROMPT):
        super().__init__(tokenizer, tools, config)
        self.planner_prompt = planner_prompt
        self.synthesizer_prompt = synthesizer_prompt

    def planner_context(self, question: str, summary: str,
                        messages: Messages | None = None) -> list[int]:
        if messages:
            return self.chat.chat_ids(self._with_notes(messages, summary), self.planner_prompt,
                                      self.specs)
        safe = self.chat.safe_text
        user = f"Question: {safe(question)}\n\nNotes so far:\n{safe(summary) or NO_NOTES}"
        return self.chat.prompt_ids(self.planner_prompt, user, self.specs)

    @staticmethod
    def _with_notes(messages: Messages, summary: str) -> list[dict[str, Any]]:
        """The data's chat, its last user turn followed by the notes (escaped with it)."""
        msgs = [dict(m) for m in messages]
        last = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=None)
        if last is not None:
            msgs[last]["content"] = (f"{msgs[last]['content']}\n\nNotes so far:\n"
                                     f"{summary or NO_NOTES}")
        return msgs

    def synthesizer_context(self, question: str, summary: str, calls: list[ToolCall]) -> list[int]:
        safe, limit = self.chat.safe_text, self.config.limits.max_observation_tokens
        evidence = "\n".join(
            f"[{i}] {safe(c.name)} {safe(json.dumps(c.arguments, ensure_ascii=False))}\n"
            f"<tool_response>\n{safe(c.observation, limit)}\n</tool_response>"
            for i, c in enumerate(calls, 1))
        # the question last, next to where the notes start: what to keep is decided by it
        user = (f"Current notes:\n{safe(summary) or NO_NOTES}\n\nNew evidence:\n{evidence}"
                f"\n\n{QUESTION_LAST}{safe(question)}")
        return self.chat.prompt_ids(self.synthesizer_prompt, user)

    def stuck(self, synth: Message, summary: str) -> bool:
        """Greedy notes that did not change: the next step would repeat this one."""
        cfg = self.config
        return (cfg.unstick_temperature > 0 and cfg.sampling.temperature == 0
                and not synth.ended and self.visible(synth.text).strip() == summary)

    async def run(self, question: str, reference: str | None, engine: RolloutEngine, *,
                  group_id: str, uid: str, resume: Resume | None = None,
                  commit: Commit | None = None, messages: Messages | None = None
                  ) -> Trajectory:
        cfg = self.config
        traj, state = self.start(question, reference, group_id, uid, resume)
        summary = state.get("summary", "")
        summaries: list[str] = traj.metadata.setdefault("summaries", [])
        seen: set[tuple[int, ...]] = set()  # Planner contexts (greedy: each fixes what follows)
        for step in range(state.get("step", 0), cfg.max_turns):
            context = self.planner_context(question, summary, messages)
            if cfg.stop_on_repeat and cfg.deterministic:
                key = tuple(context)
                if key in seen:
                    traj.add_label("repeated_state", traj.turns[-1] if traj.turns else None)
                    traj.metadata["repeated_at_step"] = step
                    break
                seen.add(key)
            plan = await self.message(engine, traj, context, "planner")
            acted = await self.act(traj, plan, step)
            if acted is None:
                break
            calls, within_budget = acted
            context = self.synthesizer_context(question, summary, calls)
            synth = await self.message(engine, traj, context, "synthesizer")
            if self.stuck(synth, summary):
                traj.metadata["unstuck"] = traj.metadata.get("unstuck", 0) + 1
                synth = await self.message(engine, traj, context, "synthesizer",
                                           temperature=cfg.unstick_temperature)
            if synth.ended:
                break
            if self.parse(synth.text).kind != "none":  # the Synthesizer may only write notes
                traj.add_label("tool_parse_error", synth.turns[-1])
            else:
                summary = self.visible(synth.text).strip()
            summaries.append(summary)
            if not within_budget:
                break
            if commit is not None:
                commit(traj, {"step": step + 1, "summary": summary})
        return traj
