"""The records every package shares, at the bottom of the layering: a rollout's `Trajectory`
(turns, tokens, log-probs, versions, rewards), the trainer's `TokenBatch` and its extras keys,
a loss's `LossOutput`, a task's `Prompt`."""
