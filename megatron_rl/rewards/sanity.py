"""The sanity task's reward: a property of the tokens themselves, so any policy (even a random
one) earns a reward with variance from its first step."""

from __future__ import annotations

from megatron_rl.records.trajectory import Trajectory


async def score_even_tokens(group: list[Trajectory]) -> None:
    """Outcome = the share of the generated tokens that have an even id."""
    for t in group:
        ids = [i for turn in t.turns for i in turn.output_ids]
        t.rewards["outcome"] = sum(i % 2 == 0 for i in ids) / max(len(ids), 1)
