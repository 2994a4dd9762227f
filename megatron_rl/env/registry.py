"""The tools a recipe can give the search task's agent (`rl.tools`); a user's own by import
path. An entry is called as `make(ctx)` with an `env.build.ToolContext` (the recipe's `env`
section, the task's own index, the aux pools' URLs, the run's cache) and returns a `Tool`
(`env/base.py`)."""

from __future__ import annotations

from megatron_rl.utils.registry import Registry

TOOLS = Registry("tool", {
    "search": "megatron_rl.env.build:search_tool",
    "visit": "megatron_rl.env.build:visit_tool",
})
