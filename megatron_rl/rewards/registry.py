"""The outcome judges a recipe can name (`rl.judge.kind`); a user's own by import path. An
entry is called with the rest of the judge spec as keywords and returns a `Judge`
(`rewards/base.py`: `await judge.judge(question, answer, reference) -> Verdict`)."""

from __future__ import annotations

from megatron_rl.utils.registry import Registry

JUDGES = Registry("judge", {
    "rule": "megatron_rl.rewards.rule:RuleJudge",
    "genrm": "megatron_rl.rewards.genrm:genrm_judge",
})
