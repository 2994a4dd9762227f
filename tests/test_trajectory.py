"""Trajectory → training sequences: tokens trained are exactly the tokens sampled."""

from __future__ import annotations

import json

import pytest

from megatron_rl.records.trajectory import (
    CONTEXT_SHARED,
    ToolCall,
    Trajectory,
    Turn,
    full_contexts,
)


def _turn(role, context, output, obs=(), version=3):
    return Turn(role, list(context), list(output), [-0.5] * len(output), [version] * len(output),
                list(obs))


def test_growing_conversation_is_one_sequence():
    t1 = _turn("agent", [1, 2, 3], [10, 11], obs=[90, 91])
    t2 = _turn("agent", [1, 2, 3, 10, 11, 90, 91], [12, 13, 14], version=4)
    seqs = Trajectory("u", "g", "q", turns=[t1, t2]).sequences()
    assert len(seqs) == 1
    s = seqs[0]
    assert s.tokens == [1, 2, 3, 10, 11, 90, 91, 12, 13, 14]
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert s.turn_index == [-1, -1, -1, 0, 0, -1, -1, 1, 1, 1]
    assert s.weight_versions == [-1, -1, -1, 3, 3, -1, -1, 4, 4, 4]
    assert s.logprobs[3] == -0.5 and s.logprobs[5] == 0.0


def test_fresh_contexts_start_new_sequences():
    planner = _turn("planner", [1, 2], [5, 6])
    synth = _turn("synthesizer", [1, 7, 8], [9])  # a new prompt, not a continuation
    planner2 = _turn("planner", [1, 2, 9], [4])
    seqs = Trajectory("u", "g", "q", turns=[planner, synth, planner2]).sequences()
    assert [s.tokens for s in seqs] == [[1, 2, 5, 6], [1, 7, 8, 9], [1, 2, 9, 4]]
    assert [s.turn_index[-1] for s in seqs] == [0, 1, 2]


def test_labels_and_status():
    traj = Trajectory("u", "g", "q", turns=[_turn("agent", [1], [2])])
    assert traj.status == "ok" and not traj.env_failure
    traj.add_label("tool_parse_error", traj.turns[0])
    traj.add_label("search_error")
    assert traj.status == "search_error"  # environment failures rank first
    assert traj.env_failure and traj.model_failure
    assert traj.turns[0].labels == ["tool_parse_error"]
    with pytest.raises(ValueError, match="unknown trajectory label 'oops'"):
        traj.add_label("oops")


def test_round_trips_through_dict():
    turn = _turn("agent", [1], [2, 3])
    turn.tool_calls.append(ToolCall("search", {"query": "x"}, observation="results"))
    traj = Trajectory("u", "g", "q", reference="a", turns=[turn], rewards={"outcome": 1.0})
    assert Trajectory.from_dict(traj.to_dict()) == traj


def test_a_dumped_turn_holds_only_the_context_the_previous_feed_did_not():
    react = [_turn("agent", [1, 2, 3], [10, 11], obs=[90, 91]),
             _turn("agent", [1, 2, 3, 10, 11, 90, 91, 5], [12, 13], obs=[92]),
             _turn("agent", [1, 2, 3, 10, 11, 90, 91, 5, 12, 13, 92], [14])]
    fresh = [_turn("planner", [1, 2, 3], [5, 6]),
             _turn("synthesizer", [1, 2, 7, 8], [9]),  # shares the opening [1, 2]
             _turn("planner", [4, 2], [6])]           # shares nothing
    for turns, contexts, shared in (
            (react, [[1, 2, 3], [5], []], [None, 7, 11]),
            (fresh, [[1, 2, 3], [7, 8], [4, 2]], [None, 2, None])):
        traj = Trajectory("u", "g", "q", turns=turns)
        row = json.loads(json.dumps(traj.to_dict()))
        assert [t["context_ids"] for t in row["turns"]] == contexts
        assert [t.get(CONTEXT_SHARED) for t in row["turns"]] == shared
        assert Trajectory.from_dict(row) == traj
        assert [t["context_ids"] for t in full_contexts(row["turns"])] == \
            [t.context_ids for t in turns]
        assert CONTEXT_SHARED in json.dumps(row)  # the input is not changed in place


def test_a_row_with_full_contexts_still_loads():
    turns = [_turn("agent", [1, 2], [3], obs=[4]), _turn("agent", [1, 2, 3, 4], [5])]
    old = {"uid": "u", "group_id": "g", "question": "q",
           "turns": [t.to_dict() for t in turns]}  # as dumps were written before
    assert Trajectory.from_dict(old).turns == turns
    assert full_contexts(old["turns"]) is old["turns"]


@pytest.mark.parametrize("bad", [-1, 6, True, "3", None])
def test_a_shared_count_that_does_not_fit_is_refused_naming_the_turn(bad):
    row = Trajectory("u", "g", "q", turns=[_turn("agent", [1, 2], [3], obs=[4]),
                                           _turn("agent", [1, 2, 3, 4], [5])]).to_dict()
    assert row["turns"][1][CONTEXT_SHARED] == 4
    row["turns"][1][CONTEXT_SHARED] = bad
    with pytest.raises(ValueError, match=r"turns\[1\]\.context_shared: expected an integer "
                                         r"from 0 to 4"):
        Trajectory.from_dict(row)
    first = Trajectory("u", "g", "q", turns=[_turn("agent", [1, 2], [3])]).to_dict()
    first["turns"][0][CONTEXT_SHARED] = 1  # nothing came before the first turn
    with pytest.raises(ValueError, match=r"turns\[0\]\.context_shared"):
        Trajectory.from_dict(first)


def test_misaligned_turn_is_refused():
    with pytest.raises(ValueError, match="2 output ids but 1 log-probs"):
        Turn("agent", [1], [2, 3], [-0.1], [0, 0])


def test_a_masked_turn_keeps_its_tokens_but_trains_none():
    t1 = _turn("agent", [1], [2, 3], obs=[9])
    t1.loss_mask = [0, 0]  # e.g. a turn an SFT judge marked MASK
    t2 = _turn("agent", [1, 2, 3, 9], [4])
    (seq,) = Trajectory("u", "g", "q", turns=[t1, t2]).sequences()
    assert seq.tokens == [1, 2, 3, 9, 4] and seq.loss_mask == [0, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="a loss mask of 1"):
        Turn("agent", [1], [2, 3], [0.0, 0.0], [0, 0], loss_mask=[1])


def _deep(levels: int) -> dict:
    value: object = [1.0]
    for i in range(levels):
        value = {f"k{i}": value}
    return value  # type: ignore[return-value]


def test_to_dict_is_strict_json_for_any_tool_call_arguments():
    """The parser bounds model-written arguments; to_dict is the backstop for a ToolCall built
    anywhere else: 500 levels, NaN/Infinity, lone surrogates, non-JSON types all write."""
    from megatron_rl.records.trajectory import MAX_JSON_DEPTH, json_safe
    from megatron_rl.rollout.forest import RolloutForest

    turn = _turn("agent", [1], [2])
    turn.tool_calls = [
        ToolCall("search", _deep(500), error="tool_parse_error"),
        ToolCall("search", {"q": float("nan"), "r": [float("inf"), -float("inf")],
                            "s": "a\ud800", "\udc00": {1, 2}}),
        ToolCall("visit", {"url": "https://x.org", "n": [1, 2.5, None, True]}),
    ]
    traj = Trajectory("u", "g", "q", turns=[turn])
    row = json.loads(json.dumps(traj.to_dict(), allow_nan=False))
    deep, odd, plain = row["turns"][0]["tool_calls"]
    for _ in range(MAX_JSON_DEPTH):  # MAX_JSON_DEPTH levels kept, then a marker
        (deep_key,) = deep["arguments"]
        deep["arguments"] = deep["arguments"][deep_key]
    assert deep["arguments"] == f"<dict nested deeper than {MAX_JSON_DEPTH} levels>"
    assert odd["arguments"] == {"q": "nan", "r": ["inf", "-inf"], "s": "a\\ud800",
                                "\\udc00": "<set>"}
    assert plain == {"name": "visit", "arguments": {"url": "https://x.org",
                                                    "n": [1, 2.5, None, True]},
                     "error": None, "observation": ""}
    # the forest stores the same plain form, so a checkpoint writes too
    forest = RolloutForest()
    node = forest.commit(forest.root("g"), traj, {"step": 1})
    json.dumps(forest.state_dict(), allow_nan=False)
    assert forest.resume(node)[0].turns[0].tool_calls[2] == turn.tool_calls[2]
    # plain data comes back equal, tuples as lists
    data = {"a": [1, {"b": (2, "c")}], "d": -0.0, "e": 10**30}
    assert json_safe(data) == {"a": [1, {"b": [2, "c"]}], "d": -0.0, "e": 10**30}
    assert json_safe([10**5000]) == ["<int of 16610 bits>"]  # past the int/str digit limit


def test_turn_to_dict_is_asdict_with_copies_of_the_lists():
    """Every field, in declaration order, equal to `dataclasses.asdict` (bar the tool calls'
    own `to_dict`), and no list shared with the live turn."""
    import dataclasses

    turn = Turn("agent", [1, 2], [3, 4], [-0.5, -1.0], [7, 7], [9], finish_reason="length",
                text="hi", rewards={"rubric": 0.5}, labels=["degenerate"], loss_mask=[1, 0],
                routed_experts=[[[0, 1]], [[2, 3]], [[1, 2]]])
    turn.tool_calls.append(ToolCall("search", {"query": "x"}, observation="r"))
    d = turn.to_dict()
    assert list(d) == [f.name for f in dataclasses.fields(Turn)]
    plain = dataclasses.asdict(turn)
    plain["tool_calls"] = [c.to_dict() for c in turn.tool_calls]
    assert d == plain
    for name in ("context_ids", "output_ids", "output_logprobs", "loss_mask", "labels"):
        assert d[name] is not getattr(turn, name)
    d["routed_experts"][0][0][0] = 99
    assert turn.routed_experts[0][0][0] == 0
