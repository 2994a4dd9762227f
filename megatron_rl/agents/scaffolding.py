"""The text every episode repeats: the agents' system prompts with the built-in tools' specs,
as the chat template renders them. A tokenizer trained with it (`megatron-rl data tokenizer`)
spends merges on it, which halves a tiny policy's contexts (the Planner's system prompt: ~980
-> ~430 tokens at 2048 ids)."""

from __future__ import annotations

from megatron_rl.agents.itersynth import PLANNER_PROMPT, SYNTHESIZER_PROMPT
from megatron_rl.agents.react import REACT_SYSTEM_PROMPT
from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.env.base import tool_spec
from megatron_rl.env.search import LocalSearch
from megatron_rl.env.visit import Visit


def agent_scaffolding() -> list[str]:
    """The rendered system turns of ReAct, the Planner (with tools) and the Synthesizer."""
    render = tiny_qwen3_tokenizer().apply_chat_template
    specs = [tool_spec(LocalSearch), tool_spec(Visit)]
    turns = [render([{"role": "system", "content": p}, {"role": "user", "content": ""}],
                    tools=specs, tokenize=False) for p in (PLANNER_PROMPT, REACT_SYSTEM_PROMPT)]
    turns.append(render([{"role": "system", "content": SYNTHESIZER_PROMPT},
                         {"role": "user", "content": ""}], tokenize=False))
    return turns
