"""Tasks: what `megatron-rl train` trains on — prompts, the agent, how a finished group is
scored. Importing this package creates every role's registry, so a config's registry fields
are checked against all of them (agents, tasks, tools, judges, reward managers, engines)."""

from megatron_rl.agents.registry import AGENTS
from megatron_rl.algorithms.reward_managers import REWARD_MANAGERS
from megatron_rl.engines.registry import ENGINES
from megatron_rl.env.registry import TOOLS
from megatron_rl.rewards.registry import JUDGES
from megatron_rl.tasks.base import TASKS, Task, build_task

__all__ = ["AGENTS", "ENGINES", "JUDGES", "REWARD_MANAGERS", "TASKS", "TOOLS", "Task",
           "build_task"]
