"""Judges and rewards: rule and GenRM outcome judges, IterSynth rubric scoring, the composite
reward written on Trajectories, and the abnormal-trajectory taxonomy metrics (docs/rewards.md).
"""

from megatron_rl.rewards.base import Judge, Verdict, extract_answer
from megatron_rl.rewards.composite import RewardWeights, build_judge, score_group, turn_rewards
from megatron_rl.rewards.genrm import GenRMJudge
from megatron_rl.rewards.rubric import RubricError, RubricScorer, load_rubrics
from megatron_rl.rewards.rule import RuleJudge
from megatron_rl.rewards.taxonomy import taxonomy_metrics
from megatron_rl.utils.chat_client import ChatClient, ClientConfig

__all__ = ["ChatClient", "ClientConfig", "GenRMJudge", "Judge", "RewardWeights", "RubricError",
           "RubricScorer", "RuleJudge", "Verdict", "build_judge", "extract_answer",
           "load_rubrics", "score_group", "taxonomy_metrics", "turn_rewards"]
