"""The reward managers, selectable by name: `turn_advantages(name, trajectories, ...)` returns
per-turn advantages (None = not trained) and metrics for one batch of groups.

| name | reward | normalised over |
|---|---|---|
| `grpo`, `end_to_end` | w_outcome * outcome, the same on every turn | the group's trajectories |
| `rdpo` | per turn: w_outcome * outcome + w_rubric * rubric_k | (group, role) turn pools |
| `rdpo_mixed` | as `rdpo` | the group's turns, roles mixed |
| `pipeline_outcome` | per turn: w_outcome * outcome | (group, role) turn pools |
| `c_grpo` | w_outcome * outcome + w_process * process | the group's trajectories |
| `intermediate_fact` | w_outcome * outcome + w_fact * fact recall | the group's trajectories |

The normaliser is any estimator of `advantages.py` (grpo, dr_grpo, rloo); a trajectory-level
advantage is broadcast to every turn. Exclusion follows `trajectory_flags` for every manager:
environment failures (and trajectories without an outcome) are out of the statistics and get
None on every turn; `exclude_max_turns_from_loss` keeps `max_turns` in the statistics but
gives it None.

C-GRPO (single-agent, three-step process evaluation). The process score is the mean of three
0/1 checks of the trajectory, so it lies in {0, 1/3, 2/3, 1}:
  1. retrieval: it made at least one tool call, and every call succeeded (no error) with a
     non-empty observation. Calls on a turn labelled `max_turns` were never run (the step
     limit) and are not judged.
  2. evidence: some successful call's observation contains a reference answer.
  3. grounding: the final answer (None when truncated, as for the judge) is contained in
     some successful call's observation, i.e. the answer is supported by what it saw.
"Contains" is a match at word boundaries after SQuAD normalisation (`rule.normalize_answer`:
lowercase, no punctuation, no articles); a reference may be a JSON list of answers.

Intermediate fact (v1). A multi-hop question carries its bridge entities in
`Trajectory.metadata["facts"]` (from `data.world.Question.facts`). A fact is surfaced by a
turn when it is contained (as above) in the turn's generated text or in the observation of one
of its successful tool calls; recall = the fraction of the (distinct) facts surfaced anywhere
in the trajectory. A trajectory without facts gets recall 0 (its reward is the outcome part);
`reward/fact_recall` averages over the counted trajectories that have facts.
Per-turn variant (`intermediate_fact_turn_advantages`, not in the registry): turn k's reward
is w_outcome * outcome + w_fact * (facts first surfaced in turn k) / (number of facts), so the
fact parts of a trajectory's turns add up to w_fact * recall; the turn that made the tool call
gets the credit for what its observation shows (in IterSynth the Planner's turn, since the
Synthesizer only rewrites what was already surfaced). Turns are pooled by (group, role), as RDPO.

Metrics: `adv/excluded_fraction`, `adv/masked_fraction` (per trajectory), and over the turns
of counted trajectories `reward/<role>_mean` and `reward/<role>_std` (population std) of the
reward each turn was normalised with; c_grpo adds `reward/process_mean` and the three checks'
means, intermediate_fact adds `reward/fact_recall`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_rl.algorithms.advantages import Estimator, group_normalize, trajectory_flags
from megatron_rl.algorithms.rdpo import TurnAdvantages, rdpo_advantages
from megatron_rl.rewards.base import references
from megatron_rl.rewards.composite import RewardWeights, final_answer, is_truncated, turn_rewards
from megatron_rl.rewards.rule import normalize_answer
from megatron_rl.rollout.trajectory import ToolCall, Trajectory, Turn

REWARD_MANAGERS = ("grpo", "rdpo", "rdpo_mixed", "pipeline_outcome", "end_to_end", "c_grpo",
                   "intermediate_fact")


def contains(text: str, needle: str) -> bool:
    """`needle` occurs in `text` at word boundaries, both SQuAD-normalised; never for an empty
    needle."""
    n = normalize_answer(needle)
    return bool(n) and f" {n} " in f" {normalize_answer(text)} "


def _judged_calls(turn: Turn) -> list[ToolCall]:
    return [] if "max_turns" in turn.labels else turn.tool_calls


def _observations(turn: Turn) -> list[str]:
    return [c.observation for c in _judged_calls(turn) if c.error is None and c.observation]


# -- C-GRPO's process evaluation --------------------------------------------------------------

@dataclass
class ProcessChecks:
    retrieval: bool
    evidence: bool
    grounding: bool

    @property
    def score(self) -> float:
        return (self.retrieval + self.evidence + self.grounding) / 3


def process_checks(traj: Trajectory) -> ProcessChecks:
    calls = [c for t in traj.turns for c in _judged_calls(t)]
    observations = [o for t in traj.turns for o in _observations(t)]
    retrieval = bool(calls) and all(c.error is None and c.observation for c in calls)
    refs = references(traj.reference) if traj.reference is not None else []
    evidence = any(contains(o, r) for o in observations for r in refs)
    answer = None if is_truncated(traj) else final_answer(traj)
    grounding = answer is not None and any(contains(o, answer) for o in observations)
    return ProcessChecks(retrieval, evidence, grounding)


# -- intermediate facts -----------------------------------------------------------------------

def _facts(traj: Trajectory) -> list[str]:
    facts = traj.metadata.get("facts") or []
    facts = [facts] if isinstance(facts, str) else facts
    return list({normalize_answer(f): f for f in facts if normalize_answer(f)}.values())


def facts_by_turn(traj: Trajectory) -> list[int]:
    """How many of the trajectory's facts each turn surfaces first."""
    left, out = _facts(traj), []
    for turn in traj.turns:
        texts = [turn.text, *_observations(turn)]
        new = [f for f in left if any(contains(x, f) for x in texts)]
        left = [f for f in left if f not in new]
        out.append(len(new))
    return out


def fact_recall(traj: Trajectory) -> float | None:
    """Fraction of the facts surfaced anywhere in the trajectory; None without facts."""
    n = len(_facts(traj))
    return sum(facts_by_turn(traj)) / n if n else None


def intermediate_fact_turn_advantages(trajectories: Sequence[Trajectory], *,
                                      outcome_weight: float = 1.0, fact_weight: float = 0.5,
                                      estimator: Estimator = "grpo",
                                      exclude_max_turns_from_loss: bool = False
                                      ) -> list[TurnAdvantages]:
    """The per-turn variant: each turn credited with the facts it surfaced first."""
    in_stats, in_loss = trajectory_flags(trajectories, "outcome", exclude_max_turns_from_loss)
    values, keys, include = [], [], []
    for traj, counted in zip(trajectories, in_stats, strict=True):
        n = len(_facts(traj)) if counted else 0
        credit = facts_by_turn(traj) if n else [0] * len(traj.turns)
        base = outcome_weight * traj.rewards["outcome"] if counted else 0.0
        for turn, c in zip(traj.turns, credit, strict=True):
            values.append(base + fact_weight * c / n if n else base)
            keys.append((traj.group_id, turn.role))
            include.append(counted)
    flat = iter(group_normalize(values, keys, include, estimator=estimator))
    return [[a if trained else None for a in [next(flat) for _ in t.turns]]
            for t, trained in zip(trajectories, in_loss, strict=True)]


# -- the registry -----------------------------------------------------------------------------

def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _role_metrics(trajectories: Sequence[Trajectory], rewards: Sequence[list[float] | None]
                  ) -> dict[str, float]:
    by_role: dict[str, list[float]] = {}
    for traj, rs in zip(trajectories, rewards, strict=True):
        for turn, r in zip(traj.turns, rs, strict=True) if rs is not None else ():
            by_role.setdefault(turn.role, []).append(r)
    out = {}
    for role, xs in by_role.items():
        m = _mean(xs)
        out[f"reward/{role}_mean"] = m
        out[f"reward/{role}_std"] = math.sqrt(_mean([(x - m) ** 2 for x in xs]))
    return out


def turn_advantages(name: str, trajectories: Sequence[Trajectory], *,
                    estimator: Estimator = "grpo", exclude_max_turns_from_loss: bool = False,
                    outcome_weight: float = 1.0, rubric_weight: float = 1.0,
                    process_weight: float = 0.5, fact_weight: float = 0.5
                    ) -> tuple[list[TurnAdvantages], dict[str, float]]:
    """Per-turn advantages of reward manager `name` (one of REWARD_MANAGERS) and its metrics."""
    if name not in REWARD_MANAGERS:
        raise ValueError(f"reward manager {name!r}: one of {', '.join(REWARD_MANAGERS)}")
    trajectories = list(trajectories)
    in_stats, in_loss = trajectory_flags(trajectories, "outcome", exclude_max_turns_from_loss)
    n = max(len(trajectories), 1)
    metrics = {"adv/excluded_fraction": sum(not s for s in in_stats) / n,
               "adv/masked_fraction": sum(not m for m in in_loss) / n}

    if name in ("rdpo", "rdpo_mixed", "pipeline_outcome"):
        weights = RewardWeights(outcome_weight, 0.0 if name == "pipeline_outcome"
                                else rubric_weight)
        adv = rdpo_advantages(trajectories, weights, mixed_roles=name == "rdpo_mixed",
                              estimator=estimator,
                              exclude_max_turns_from_loss=exclude_max_turns_from_loss)
        turn_values = [turn_rewards(t, weights) if s else None
                       for t, s in zip(trajectories, in_stats, strict=True)]
        return adv, {**metrics, **_role_metrics(trajectories, turn_values)}

    counted = [i for i, s in enumerate(in_stats) if s]
    bonus = [0.0] * len(trajectories)  # the part added to w_outcome * outcome
    extra: dict[str, float] = {}
    if name == "c_grpo":
        checks = [process_checks(trajectories[i]) for i in counted]
        for i, c in zip(counted, checks, strict=True):
            bonus[i] = process_weight * c.score
        extra = {"reward/process_mean": _mean([c.score for c in checks]),
                 "reward/retrieval_mean": _mean([c.retrieval for c in checks]),
                 "reward/evidence_mean": _mean([c.evidence for c in checks]),
                 "reward/grounding_mean": _mean([c.grounding for c in checks])}
    elif name == "intermediate_fact":
        recall = [fact_recall(trajectories[i]) for i in counted]
        for i, r in zip(counted, recall, strict=True):
            bonus[i] = fact_weight * (r or 0.0)
        extra = {"reward/fact_recall": _mean([r for r in recall if r is not None])}
    values = [outcome_weight * t.rewards["outcome"] + b if s else 0.0
              for t, b, s in zip(trajectories, bonus, in_stats, strict=True)]
    adv = group_normalize(values, [t.group_id for t in trajectories], in_stats,
                          estimator=estimator)
    out = [[a if trained else None] * len(t.turns)
           for t, a, trained in zip(trajectories, adv, in_loss, strict=True)]
    turn_values = [[v] * len(t.turns) if s else None
                   for t, v, s in zip(trajectories, values, in_stats, strict=True)]
    return out, {**metrics, **_role_metrics(trajectories, turn_values), **extra}
