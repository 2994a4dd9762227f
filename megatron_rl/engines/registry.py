"""The engine servers a recipe can launch (`rollout.engine`, `rollout.aux_pools.*.engine`); a
user's own by import path. An entry is an `EngineKind` (`engines/kinds.py`): how its server
process starts and which client speaks to it."""

from __future__ import annotations

from megatron_rl.utils.registry import Registry

ENGINES = Registry("engine", {
    "embedded": "megatron_rl.engines.kinds:EmbeddedKind",
    "sglang": "megatron_rl.engines.kinds:SGLangKind",
})
