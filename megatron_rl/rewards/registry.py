"""The outcome judges a recipe can name (`rl.judge.kind`) and the rubric judges
(`rl.rubric.kind`); a user's own by import path. An entry is called with the rest of the spec as
keywords and returns a `Judge` (`rewards/base.py`: `await judge.judge(question, answer,
reference) -> Verdict`) or a `TurnScorer` (`rewards/rubric.py`: `await
scorer.score_trajectory(traj)`, writing `turn.rewards["rubric"]`)."""

from __future__ import annotations

from megatron_rl.utils.registry import Registry

JUDGES = Registry("judge", {
    "rule": "megatron_rl.rewards.rule:RuleJudge",
    "genrm": "megatron_rl.rewards.genrm:genrm_judge",
})

RUBRICS = Registry("rubric", {
    "llm": "megatron_rl.rewards.rubric:llm_rubric",
    "rule": "megatron_rl.rewards.world_rubric:WorldRubricScorer",
})
