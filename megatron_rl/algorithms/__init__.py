"""RL algorithms as pure functions: advantages (GRPO family, RDPO), policy losses, rollout
importance correction (TIS) and the entropy controller. See docs/algorithms.md."""
