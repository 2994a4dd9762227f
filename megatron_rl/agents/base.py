"""The agent protocol, its configuration, and the episode machinery ReAct and IterSynth share.

An agent turns (question, engine) into a `Trajectory`. It never raises for anything the policy
or a tool does: bad output becomes a label (`tool_parse_error`, `degenerate`, …), a failed or
slow tool becomes an error observation plus an environment label. Only the engine itself
failing (`EngineError`, a dead connection) propagates: that is the scheduler's to retry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from megatron_rl.agents.chat import ChatFormat
from megatron_rl.agents.formats import CHOICES as CHAT_FORMATS
from megatron_rl.agents.tool_parser import Action, parse_action, visible_text
from megatron_rl.config.schema import AgentLimitsConfig
from megatron_rl.engines.base import (
    EngineError,
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    SamplingParams,
)
from megatron_rl.env.base import Tool, tool_spec
from megatron_rl.records.trajectory import ToolCall, Trajectory, Turn
from megatron_rl.utils.degeneracy import DEFAULT as _DEGENERACY
from megatron_rl.utils.degeneracy import DegeneracyConfig, find_degeneracy

MAX_ABORT_RESUMES = 16  # an engine that keeps aborting one request is broken, not paused


def is_degenerate(text: str, min_chars: int = 400, max_ratio: float = 0.1) -> bool:
    """Looping output, by the detector the offline filters use (`utils.degeneracy`): a
    `window` of it compressing below `max_ratio` given the text before it, a repeating block
    of lines, or a long run of one short unit. Windows shorter than `min_chars` are not
    ratio-judged (they compress poorly whatever they say)."""
    cfg = _DEGENERACY if (min_chars, max_ratio) == (400, 0.1) else \
        DegeneracyConfig(min_chars=min_chars, max_ratio=max_ratio)
    return find_degeneracy(text, cfg) is not None


@dataclass
class AgentConfig:
    """What an agent is built with. The run's values come from the schema and have no default
    here: `max_turns` (rl.max_turns), `max_context_tokens` (model.seq_length), `sampling`
    (rl.temperature, rl.max_new_tokens) and `limits`, the `rl.agent_limits` section itself
    (`tasks.base.agent_config`). The rest is not part of a recipe."""

    max_turns: int                        # assistant messages (ReAct) / planner steps (IterSynth)
    max_context_tokens: int               # a context must leave room for one full response
    sampling: SamplingParams
    limits: AgentLimitsConfig = field(default_factory=AgentLimitsConfig)
    # True for a degenerate message text; None switches the check off
    degenerate_check: Callable[[str], bool] | None = is_degenerate
    discard_all: bool = False             # eval only: on overflow restart from the question
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. enable_thinking
    # the model family's chat format (formats.py): auto (from the chat template), qwen3,
    # qwen3_5, or a model architecture (qwen3_moe, qwen3_5_moe, …)
    chat_format: str = "auto"
    return_routed_experts: bool = False   # MoE routing replay: keep the engine's routing per turn
    # reproducible rollouts: each request's sampling seed derives from it and the request id
    seed: int | None = None
    # False: the tools' JSON schemas stay out of the system prompt (~600 tokens for search and
    # visit): a small model that learned the call format in SFT copies names across them poorly
    tool_specs: bool = True
    # greedy decoding only (IterSynth): a Synthesizer that leaves the notes unchanged after new
    # evidence makes the next step repeat the last one for the rest of the episode (the state is
    # the notes alone); it is decoded once more at this temperature. 0 = off
    unstick_temperature: float = 0.0
    # greedy decoding only (IterSynth): a Planner context seen earlier in the episode gives the
    # same plan, the same calls and so the same steps again until the turn budget; the episode
    # ends there instead, labelled `repeated_state`. Exact with tools that answer a repeated
    # call alike (the local index and pages); off for a live web whose results may change
    stop_on_repeat: bool = True

    @property
    def deterministic(self) -> bool:
        """Every message is a function of its context (greedy, never re-decoded)."""
        return self.sampling.temperature == 0 and self.unstick_temperature == 0

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_context_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentConfig.{name}={getattr(self, name)} must be >= 1")
        if self.sampling.max_new_tokens < 1:
            raise ValueError("sampling.max_new_tokens must be >= 1")
        if self.sampling.max_new_tokens >= self.max_context_tokens:
            raise ValueError(f"sampling.max_new_tokens={self.sampling.max_new_tokens} leaves no "
                             f"room for a prompt in max_context_tokens={self.max_context_tokens}")
        if self.unstick_temperature < 0:
            raise ValueError(f"AgentConfig.unstick_temperature={self.unstick_temperature} must "
                             "be >= 0")
        if self.chat_format not in CHAT_FORMATS:
            raise ValueError(f"AgentConfig.chat_format={self.chat_format!r}: expected one of "
                             f"{', '.join(CHAT_FORMATS)}")


# A session's committed prefix and the agent's loop state after it (the rollout forest's node)
Resume = tuple[Trajectory, dict[str, Any]]
# called after every finished message with the trajectory so far and the loop state to resume at
Commit = Callable[[Trajectory, dict[str, Any]], None]
# the data's own chat (`Prompt.messages`): [{"role": ..., "content": ...}, ...]
Messages = Sequence[Mapping[str, Any]]


@runtime_checkable
class Agent(Protocol):
    async def run(self, question: str, reference: str | None, engine: RolloutEngine, *,
                  group_id: str, uid: str, resume: Resume | None = None,
                  commit: Commit | None = None, messages: Messages | None = None
                  ) -> Trajectory:
        """Run an episode, or continue one from `resume` (a prefix an earlier `commit` saw).
        With `messages` (the data's chat) the first context is that chat rendered by the chat
        template instead of the agent's own system prompt + question."""
        ...


def failure_label(tool: Tool, error: str | None) -> str:
    """Trajectory label for a failed tool call. The tool's own label when it names a backend;
    bad arguments are the model's fault; timeouts, rate limits and exceptions are charged to
    the tool's backend: its `failure_label` (env's tools set it), else what its name says."""
    if error in ("search_error", "visit_error", "summarizer_error"):
        return error
    if error == "bad_arguments":
        return "tool_parse_error"
    own = getattr(tool, "failure_label", None)
    if own in ("search_error", "visit_error", "summarizer_error"):
        return own
    name = tool.name.lower()
    if "summar" in name:
        return "summarizer_error"
    return "search_error" if "search" in name else "visit_error"


@dataclass
class Message:
    """One assistant message: its engine calls (one, or more when a cut output was resumed)."""

    turns: list[Turn]
    output_ids: list[int]
    text: str
    ended: bool  # the episode ended inside it (a label says why)


class BaseAgent:
    """Shared episode steps: generate one message, parse it, run its tool calls."""

    def __init__(self, tokenizer: Any, tools: Sequence[Tool], config: AgentConfig):
        self.config = config
        self.chat = ChatFormat(tokenizer, chat_template_kwargs=self.config.chat_template_kwargs,
                               family=self.config.chat_format)
        self.tools: dict[str, Tool] = {t.name: t for t in tools}
        self.specs = [tool_spec(t) for t in tools] if config.tool_specs else None
        self.schemas = {t.name: t.parameters for t in tools}
        stops = sorted(set(self.config.sampling.stop_token_ids) | {self.chat.im_end_id})
        self.sampling = dataclasses.replace(self.config.sampling, stop_token_ids=stops)

    @staticmethod
    def start(question: str, reference: str | None, group_id: str, uid: str,
              resume: Resume | None) -> Resume:
        if resume is not None:
            return resume
        return Trajectory(uid=uid, group_id=group_id, question=question,
                          reference=reference), {}

    def sampling_for(self, rid: str) -> SamplingParams:
        if self.config.seed is None:
            return self.sampling
        return dataclasses.replace(self.sampling,
                                   seed=zlib.crc32(f"{self.config.seed}:{rid}".encode()))

    def routed_experts(self, rid: str, res: GenerateResult) -> list[Any] | None:
        """The engine's routing of the turn (routing replay), as JSON-friendly lists."""
        if not self.config.return_routed_experts:
            return None
        if res.routed_experts is None:
            raise EngineError(f"request {rid}: routed experts were asked for but not returned "
                              "(SGLang needs --enable-return-routed-experts)",
                              endpoint="/generate")
        return res.routed_experts.tolist()

    def overflows(self, context: Sequence[int]) -> bool:
        return len(context) + self.sampling.max_new_tokens > self.config.max_context_tokens

    async def message(self, engine: RolloutEngine, traj: Trajectory, context: list[int],
                      role: str, temperature: float | None = None) -> Message:
        """Generate until the message ends: a cut (`length`) output is resumed from context +
        output up to `max_continuations` times, an aborted one (weight update) always.
        `temperature` overrides the configured one for this message."""
        cfg = self.config
        out: list[int] = []
        turns: list[Turn] = []
        cuts = aborts = 0
        while True:
            if self.overflows(context):
                traj.add_label("overlong", traj.turns[-1] if traj.turns else None)
                return Message(turns, out, self.chat.decode(out), True)
            rid = f"{traj.uid}/{len(traj.turns)}"
            sampling = self.sampling_for(rid)
            if temperature is not None:
                sampling = dataclasses.replace(sampling, temperature=temperature)
            res = await engine.generate(GenerateRequest(
                rid, list(context), sampling,
                return_routed_experts=cfg.return_routed_experts))
            turn = Turn(role, list(context), list(res.output_ids), list(res.output_logprobs),
                        list(res.weight_versions), finish_reason=res.finish_reason,
                        text=self.chat.decode(res.output_ids),
                        routed_experts=self.routed_experts(rid, res))
            traj.turns.append(turn)
            turns.append(turn)
            out += res.output_ids
            text = self.chat.decode(out)
            if cfg.degenerate_check is not None and cfg.degenerate_check(text):
                traj.add_label("degenerate", turn)
                return Message(turns, out, text, True)
            if res.finish_reason == "stop":
                return Message(turns, out, text, False)
            if res.finish_reason == "abort":
                aborts += 1
                if aborts > MAX_ABORT_RESUMES:
                    raise EngineError(f"request {rid} aborted {aborts} times")
            else:
                cuts += 1
                if cuts > cfg.limits.max_continuations:  # longer than any response may be
                    traj.add_label("response_too_long", turn)
                    return Message(turns, out, text, True)
            context = context + list(res.output_ids)

    def parse(self, text: str) -> Action:
        # an output that starts inside the prompt's open think block acts only after `</think>`
        return parse_action(self.chat.think_prefix + text, self.schemas)

    def visible(self, text: str) -> str:
        return visible_text(self.chat.think_prefix + text)

    async def act(self, traj: Trajectory, msg: Message, step: int
                  ) -> tuple[list[ToolCall], bool] | None:
        """Parse a finished message and run its tool calls: (calls, within the episode's call
        budget), or None when the episode ends here (an answer, no action, the last allowed
        step, or a label raised while generating)."""
        if msg.ended:
            return None
        action = self.parse(msg.text)
        last = msg.turns[-1]
        if action.kind == "answer":
            traj.answer = action.answer
            return None
        if action.kind == "none":
            return None
        if step == self.config.max_turns - 1:  # acting on the last allowed step: nothing follows
            last.tool_calls = action.calls
            for label in [c.error for c in action.errors] + ["max_turns"]:
                traj.add_label(label, last)
            return None
        within_budget = self.budget_calls(traj, action.calls)
        await self.run_calls(traj, last, action.calls)
        return action.calls, within_budget

    def budget_calls(self, traj: Trajectory, calls: list[ToolCall]) -> bool:
        """Mark valid calls past the per-turn and per-episode budgets as not run. False when the
        episode's budget was exceeded (the episode ends after this turn)."""
        cfg = self.config.limits
        used = traj.metadata.get("tool_calls", 0)
        valid = [c for c in calls if c.error is None]
        left = cfg.max_tool_calls - used
        for c in valid[min(cfg.max_tool_calls_per_turn, left):]:
            c.error = "excess_tool_calls"
            c.observation = (f"Error: call not run: at most {cfg.max_tool_calls_per_turn} tool "
                             f"calls per turn and {cfg.max_tool_calls} per episode")
        return len(valid) <= left

    async def run_calls(self, traj: Trajectory, turn: Turn, calls: list[ToolCall]) -> None:
        """Run the valid calls concurrently; every call ends with an observation, failures with
        a label. Attaches the calls to the turn."""
        turn.tool_calls = calls
        runs = [self._run_one(c) for c in calls if c.error is None]
        traj.metadata["tool_calls"] = traj.metadata.get("tool_calls", 0) + len(runs)
        await asyncio.gather(*runs)
        for c in calls:
            if c.error is not None:
                traj.add_label(c.error, turn)

    async def _run_one(self, call: ToolCall) -> None:
        tool = self.tools[call.name]
        timeout = self.config.limits.tool_timeout_s
        try:
            result = await asyncio.wait_for(tool(**call.arguments), timeout)
        except TimeoutError:
            call.error = failure_label(tool, "timeout")
            call.observation = f"Error: {call.name} timed out after {timeout:g} s"
            return
        except Exception as e:  # a broken tool must not end the episode
            call.error = failure_label(tool, None)
            call.observation = f"Error: {call.name} failed ({type(e).__name__})"
            return
        if getattr(result, "ok", False):
            call.observation = str(result.content)
        else:
            error = getattr(result, "error", None)
            call.error = failure_label(tool, error)
            call.observation = str(getattr(result, "content", "") or f"Error: {error}")
