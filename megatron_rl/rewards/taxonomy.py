"""Per-step metrics of the abnormal-trajectory taxonomy, as one flat dict for `MetricsLogger`.

Rates are over the step's trajectories unless the key says otherwise:
- `abnormal/<label>_rate` for every label in the taxonomy, `abnormal/env_failure_rate`,
  `abnormal/model_failure_rate`, `abnormal/ok_rate` (no label at all);
- `rollout/pass_rate` (outcome >= pass_threshold; unjudged count as failed),
  `rollout/judged_pass_rate` (over trajectories with an outcome), `reward/outcome_mean`;
- `rollout/turns_mean`, `rollout/<role>_turns_mean`, `rollout/output_tokens_mean`,
  `rollout/length_finish_rate` (over turns);
- `tools/calls_mean`, `tools/<name>_calls` (total), `tools/<name>_error_rate` (over its calls);
- `reward/<role>/<key>_mean` for every per-turn reward key (e.g. rubric), and with `weights`
  `reward/<role>/turn_reward_mean` (the composite per-turn reward, env failures left out).
"""

from __future__ import annotations

import re
from collections import defaultdict

from megatron_rl.records.trajectory import LABELS, Trajectory
from megatron_rl.rewards.composite import RewardWeights, turn_rewards

_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def taxonomy_metrics(trajectories: list[Trajectory], *, pass_threshold: float = 1.0,
                     weights: RewardWeights | None = None) -> dict[str, float]:
    n = len(trajectories)
    out: dict[str, float] = {"rollout/trajectories": float(n)}
    if n == 0:
        return out
    for label in LABELS:
        out[f"abnormal/{label}_rate"] = sum(label in t.labels for t in trajectories) / n
    out["abnormal/env_failure_rate"] = sum(t.env_failure for t in trajectories) / n
    out["abnormal/model_failure_rate"] = sum(t.model_failure for t in trajectories) / n
    out["abnormal/ok_rate"] = sum(t.status == "ok" for t in trajectories) / n

    outcomes = [t.rewards["outcome"] for t in trajectories if "outcome" in t.rewards]
    passed = sum(o >= pass_threshold for o in outcomes)
    out["rollout/pass_rate"] = passed / n
    if outcomes:
        out["rollout/judged_pass_rate"] = passed / len(outcomes)
        out["reward/outcome_mean"] = _mean(outcomes)

    turns = [turn for t in trajectories for turn in t.turns]
    out["rollout/turns_mean"] = len(turns) / n
    out["rollout/output_tokens_mean"] = sum(len(x.output_ids) for x in turns) / n
    if turns:
        out["rollout/length_finish_rate"] = sum(x.finish_reason == "length"
                                                for x in turns) / len(turns)

    role_turns: dict[str, int] = defaultdict(int)
    role_rewards: dict[str, list[float]] = defaultdict(list)
    tool_calls: dict[str, int] = defaultdict(int)
    tool_errors: dict[str, int] = defaultdict(int)
    for x in turns:
        role_turns[x.role] += 1
        for key, value in x.rewards.items():
            role_rewards[f"reward/{x.role}/{key}_mean"].append(value)
        for call in x.tool_calls:
            # model-written names can be anything: keep the key set bounded
            name = call.name if _TOOL_NAME.fullmatch(call.name or "") else "other"
            tool_calls[name] += 1
            tool_errors[name] += call.error is not None
    for role, count in sorted(role_turns.items()):
        out[f"rollout/{role}_turns_mean"] = count / n
    out["tools/calls_mean"] = sum(tool_calls.values()) / n
    out["reward/rubric_failed_turns"] = float(sum(t.metadata.get("rubric_failed_turns", 0)
                                                  for t in trajectories))
    for name, count in sorted(tool_calls.items()):
        out[f"tools/{name}_calls"] = float(count)
        out[f"tools/{name}_error_rate"] = tool_errors[name] / count
    for key, values in sorted(role_rewards.items()):
        out[key] = _mean(values)

    if weights is not None:
        per_role: dict[str, list[float]] = defaultdict(list)
        for t in trajectories:
            rewards = turn_rewards(t, weights)
            for turn, r in zip(t.turns, rewards or []):
                per_role[turn.role].append(r)
        for role, values in sorted(per_role.items()):
            out[f"reward/{role}/turn_reward_mean"] = _mean(values)
    return out
