"""Judges and rewards: rule and GenRM outcome judges, IterSynth rubric scoring (an LLM judge or
rules over the known path), the composite reward written on Trajectories, and the
abnormal-trajectory taxonomy metrics (docs/rewards.md).
"""

from megatron_rl.rewards.base import Judge, Verdict, extract_answer
from megatron_rl.rewards.composite import (
    RewardWeights,
    build_judge,
    build_rubric,
    score_group,
    turn_rewards,
)
from megatron_rl.rewards.genrm import GenRMJudge
from megatron_rl.rewards.rubric import RubricError, RubricScorer, TurnScorer, load_rubrics
from megatron_rl.rewards.rule import RuleJudge
from megatron_rl.rewards.taxonomy import taxonomy_metrics
from megatron_rl.rewards.world_rubric import WorldRubricScorer
from megatron_rl.utils.chat_client import ChatClient, ClientConfig

__all__ = ["ChatClient", "ClientConfig", "GenRMJudge", "Judge", "RewardWeights", "RubricError",
           "RubricScorer", "RuleJudge", "TurnScorer", "Verdict", "WorldRubricScorer",
           "build_judge", "build_rubric", "extract_answer", "load_rubrics", "score_group",
           "taxonomy_metrics", "turn_rewards"]
