"""The tools a recipe can give the search task's agent (`rl.tools`); a user's own by import
path. An entry is called as `make(index=FOLDER)` (the task's local search index) and returns a
`Tool` (`env/base.py`)."""

from __future__ import annotations

from megatron_rl.utils.registry import Registry

TOOLS = Registry("tool", {
    "search": "megatron_rl.env.search:LocalSearch",
    "visit": "megatron_rl.env.visit:local_visit",
})
