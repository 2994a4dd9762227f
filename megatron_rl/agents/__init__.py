"""Agents: turn a question and a rollout engine into a Trajectory (see docs/agents.md)."""

from megatron_rl.agents.base import Agent, AgentConfig, is_degenerate
from megatron_rl.agents.chat import ChatFormat
from megatron_rl.agents.context import RetryAgent, for_eval
from megatron_rl.agents.formats import ChatFamily, chat_family
from megatron_rl.agents.itersynth import IterSynthAgent
from megatron_rl.agents.react import ReActAgent
from megatron_rl.agents.tool_parser import Action, parse_action

__all__ = ["Action", "Agent", "AgentConfig", "ChatFamily", "ChatFormat", "IterSynthAgent",
           "ReActAgent", "RetryAgent", "chat_family", "for_eval", "is_degenerate", "parse_action"]
