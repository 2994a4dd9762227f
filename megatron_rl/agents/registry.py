"""The agents a recipe can name (`rl.agent`); a user's own by import path. An agent is built as
`cls(tokenizer, tools, AgentConfig)` and runs `await agent.run(question, reference, engine,
group_id=..., uid=..., resume=..., commit=...) -> Trajectory` (`agents/base.py`)."""

from __future__ import annotations

from megatron_rl.utils.registry import Registry

AGENTS = Registry("agent", {
    "react": "megatron_rl.agents.react:ReActAgent",
    "itersynth": "megatron_rl.agents.itersynth:IterSynthAgent",
    "one_message": "megatron_rl.agents.one_message:OneMessageAgent",
})
