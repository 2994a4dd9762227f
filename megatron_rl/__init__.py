"""megatron-rl: RL post-training on megatron-core (docs/architecture.md)."""

from megatron_rl.utils import registry as _registry

# importing `tasks` creates every role's registry; the config imports it lazily through this
# hook (config sits below tasks, so it cannot import it itself)
_registry.PROVIDERS.append("megatron_rl.tasks")
