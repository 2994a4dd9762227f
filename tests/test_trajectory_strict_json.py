"""`Trajectory.to_dict()` is strict JSON for non-finite numbers anywhere, not only in tool calls:
a NaN log-prob from an engine, a NaN reward, odd metadata. Log-probs and rewards come back as
the same floats through `from_dict` (the forest resumes a partial rollout that way)."""

from __future__ import annotations

import json
import math

from megatron_rl.records.trajectory import ToolCall, Trajectory, Turn
from megatron_rl.rollout.forest import RolloutForest


def _hostile() -> Trajectory:
    turn = Turn("agent", [1, 2], [3, 4, 5], [-0.5, math.nan, -math.inf], [0, 0, 0],
                tool_calls=[ToolCall("search", {"q": math.inf})],
                rewards={"rubric": math.nan, "ok": 0.5})
    return Trajectory("u", "g", "q?", turns=[turn], rewards={"outcome": math.inf, "x": 1.0},
                      metadata={"score": math.nan, "big": 10 ** 5000, "t": (1, -math.inf)})


def test_to_dict_is_strict_json_for_nan_logprobs_rewards_and_metadata() -> None:
    t = _hostile()
    d = t.to_dict()
    text = json.dumps(d, allow_nan=False)  # raised ValueError before
    assert json.loads(text) == d
    turn = d["turns"][0]
    assert turn["output_logprobs"] == [-0.5, "nan", "-inf"]
    assert turn["rewards"] == {"rubric": "nan", "ok": 0.5}
    assert d["rewards"] == {"outcome": "inf", "x": 1.0}
    assert d["metadata"]["score"] == "nan" and d["metadata"]["t"] == [1, "-inf"]
    assert d["metadata"]["big"].startswith("<int of")
    # the trajectory itself is untouched
    assert math.isnan(t.turns[0].output_logprobs[1]) and t.metadata["big"] == 10 ** 5000


def test_from_dict_reads_the_non_finite_floats_back() -> None:
    back = Trajectory.from_dict(json.loads(json.dumps(_hostile().to_dict(), allow_nan=False)))
    lps = back.turns[0].output_logprobs
    assert lps[0] == -0.5 and math.isnan(lps[1]) and lps[2] == -math.inf
    assert math.isnan(back.turns[0].rewards["rubric"]) and back.turns[0].rewards["ok"] == 0.5
    assert back.rewards == {"outcome": math.inf, "x": 1.0}
    assert back.metadata["score"] == "nan"  # free-form metadata keeps json_safe's string


def test_finite_trajectories_round_trip_unchanged() -> None:
    turn = Turn("agent", [1], [2, 3], [-0.1, -0.2], [1, 1], rewards={"rubric": 0.25},
                tool_calls=[ToolCall("visit", {"url": "u"}, observation="o")])
    t = Trajectory("u", "g", "q", reference="r", turns=[turn], rewards={"outcome": 1.0},
                   metadata={"facts": ["a"], "n": 3})
    d = t.to_dict()
    assert Trajectory.from_dict(d) == t
    assert d["turns"][0]["output_logprobs"] == [-0.1, -0.2]


def test_a_forest_commit_and_resume_keep_a_nan_logprob() -> None:
    forest = RolloutForest()
    t = _hostile()
    node = forest.commit(forest.root("g"), t, {})
    json.dumps(forest.state_dict()["nodes"][-1]["turns"], allow_nan=False)
    back, _ = forest.resume(node)
    assert math.isnan(back.turns[0].output_logprobs[1])
