"""The reward-manager registry (`turn_advantages`): C-GRPO's three-step process score, the
intermediate-fact reward (and its per-turn crediting), exclusion, and every manager on an
IterSynth-shaped and a ReAct-shaped group; numbers computed by hand in the comments."""

from __future__ import annotations

import math

import pytest

from megatron_rl.algorithms.reward_managers import REWARD_MANAGERS, needs, turn_advantages
from megatron_rl.data.world import generate_world
from megatron_rl.records.trajectory import ToolCall, Trajectory, Turn
from megatron_rl.rewards.process import contains, fact_recall, facts_by_turn, process_checks
from megatron_rl.rewards.shaping import shape_rewards

MANAGERS = REWARD_MANAGERS.names()


def _adv(name: str, trajectories: list[Trajectory], **kw):
    """As the driver runs a manager: the reward writers it needs, then its advantages."""
    shape_rewards(trajectories, needs=needs(name))
    return turn_advantages(name, trajectories, **kw)


def _turn(role: str = "agent", text: str = "", calls: list[ToolCall] | None = None,
          rubric: float | None = None, finish: str = "stop") -> Turn:
    return Turn(role, [1], [7], [-0.1], [0], tool_calls=calls or [], text=text,
                finish_reason=finish, rewards={} if rubric is None else {"rubric": rubric})


def _obs(text: str, error: str | None = None) -> ToolCall:
    return ToolCall("search", {"query": "q"}, error=error, observation=text)


def _traj(uid: str, outcome: float | None, turns: list[Turn], *labels: str,
          group: str = "g", reference: str = "Marburg", answer: str | None = None,
          facts: list[str] | None = None) -> Trajectory:
    t = Trajectory(uid, group, "In which city was the founder of Zorvex Dynamics born?",
                   reference=reference, turns=turns, answer=answer,
                   rewards={} if outcome is None else {"outcome": outcome},
                   metadata={} if facts is None else {"facts": facts})
    for label in labels:
        t.add_label(label)
    return t


def _approx(rows):
    return [None if r is None else pytest.approx(r) for r in rows]


# -- C-GRPO ----------------------------------------------------------------------------------

FOUND = "Kalo Mirtan, founder of Zorvex Dynamics, was born in Marburg."


def _react(uid: str, outcome: float, calls: list[ToolCall], answer: str | None, *labels: str,
           reference: str = "Marburg", group: str = "g") -> Trajectory:
    turns = [_turn(calls=calls), _turn(text=f"<answer>{answer}</answer>")] if calls else \
        [_turn(text=f"<answer>{answer}</answer>")]
    return _traj(uid, outcome, turns, *labels, reference=reference, answer=answer, group=group)


def _c_grpo_group() -> list[Trajectory]:
    return [
        _react("A", 1.0, [_obs(FOUND)], "Marburg"),                          # 1, 1, 1
        _react("B", 1.0, [_obs(FOUND), _obs("Error: bad arguments", "tool_parse_error")],
               "Marburg"),                                                   # 0, 1, 1
        _react("C", 0.0, [_obs(FOUND)], "Marburg", reference="Berlin"),      # 1, 0, 1
        _react("D", 0.0, [_obs(FOUND)], "Hamburg"),                          # 1, 1, 0
        _react("E", 1.0, [], "Marburg"),                                     # 0, 0, 0
    ]


def test_process_checks_flip_independently():
    got = [(c.retrieval, c.evidence, c.grounding) for c in map(process_checks, _c_grpo_group())]
    assert got == [(True, True, True), (False, True, True), (True, False, True),
                   (True, True, False), (False, False, False)]
    assert [process_checks(t).score for t in _c_grpo_group()] == pytest.approx(
        [1, 2 / 3, 2 / 3, 2 / 3, 0])


def test_c_grpo_advantages():
    # reward = outcome + 0.5 * process:
    #   A 1 + 0.5 = 1.5   B 1 + 1/3 = 4/3   C 0 + 1/3   D 0 + 1/3   E 1 + 0 = 1
    #   sum 4.5, mean 0.9 -> Dr.GRPO [0.6, 0.433333, -0.566667, -0.566667, 0.1]
    adv, m = _adv("c_grpo", _c_grpo_group(), estimator="dr_grpo")
    assert adv == [_approx([0.6, 0.6]), _approx([13 / 30] * 2), _approx([-17 / 30] * 2),
                   _approx([-17 / 30] * 2), _approx([0.1])]
    assert m["reward/process_mean"] == pytest.approx(0.6)  # (1 + 3 * 2/3 + 0) / 5
    assert m["reward/retrieval_mean"] == pytest.approx(0.6)
    assert m["reward/agent_mean"] == pytest.approx((1.5 * 2 + 4 / 3 * 2 + 2 / 3 * 2 + 1) / 9)
    # process weight 1: A 2, B 5/3, C 2/3, D 2/3, E 1; mean 6/5 -> [0.8, 7/15, -8/15, -8/15, -0.2]
    adv, _ = _adv("c_grpo", _c_grpo_group(), estimator="dr_grpo", process_weight=1.0)
    assert [a[0] for a in adv] == pytest.approx([0.8, 7 / 15, -8 / 15, -8 / 15, -0.2])
    # process weight 0 is plain outcome GRPO: outcomes [1, 1, 0, 0, 1], mean 0.6
    adv, _ = _adv("c_grpo", _c_grpo_group(), estimator="dr_grpo", process_weight=0)
    assert [a[0] for a in adv] == pytest.approx([0.4, 0.4, -0.6, -0.6, 0.4])


def test_process_checks_edge_cases():
    # calls on the max_turns turn were never run: not judged (here: no judged call at all)
    unrun = _traj("u", 0.0, [_turn(calls=[_obs(FOUND)]), _turn(calls=[_obs("")])],
                  answer="Marburg")
    unrun.turns[1].labels.append("max_turns")
    assert process_checks(unrun).retrieval is True
    unrun.turns[1].labels.clear()
    assert process_checks(unrun).retrieval is False       # an empty observation fails it
    # truncated: no answer, so nothing is grounded, though the text holds one
    cut = _traj("c", 0.0, [_turn(calls=[_obs(FOUND)]),
                           _turn(text="<answer>Marburg</answer>", finish="length")])
    c = process_checks(cut)
    assert (c.retrieval, c.evidence, c.grounding) == (True, True, False)
    cut.turns[-1].finish_reason = "stop"                 # answer extracted from the last turn
    assert process_checks(cut).grounding is True
    # several acceptable references (a JSON list), word-boundary normalised matching
    many = _traj("m", 1.0, [_turn(calls=[_obs("It lies in Marburgstadt.")])],
                 reference='["Marburg", "the Marburgstadt"]', answer="marburgstadt!")
    c = process_checks(many)
    assert c.evidence and c.grounding
    assert contains("The city of Marburg, Hesse", "marburg") and not contains("Marburgstadt",
                                                                            "Marburg")
    assert not contains("anything", "the")               # normalises to nothing


# -- intermediate facts ----------------------------------------------------------------------

FACTS = ["Kalo Mirtan", "Velton"]


def _fact_group() -> list[Trajectory]:
    p = _traj("P", 1.0, [_turn(calls=[_obs("Zorvex Dynamics was founded by Kalo Mirtan.")]),
                         _turn(text="So kalo mirtan was born in velton? Let me check."),
                         _turn(calls=[_obs("Kalo Mirtan was born in Velton.")])], facts=FACTS)
    q = _traj("Q", 0.0, [_turn(calls=[_obs("Founded by Kalo Mirtan in 1950.")]),
                         _turn(text="<answer>Veltonia</answer>")], facts=FACTS)
    r = _traj("R", 0.0, [_turn(text="<answer>Paris</answer>")], facts=FACTS)
    return [p, q, r]


def test_fact_recall_and_first_surfacing():
    p, q, r = _fact_group()
    # P: fact 1 in turn 0's observation, fact 2 first in turn 1's own text ("velton?")
    assert facts_by_turn(p) == [1, 1, 0] and fact_recall(p) == 1.0
    assert facts_by_turn(q) == [1, 0] and fact_recall(q) == 0.5   # "Veltonia" is not "Velton"
    assert facts_by_turn(r) == [0] and fact_recall(r) == 0.0
    assert fact_recall(_traj("x", 1.0, [_turn(text="Velton")])) is None  # no facts
    # an errored call's observation is not surfaced evidence
    e = _traj("e", 0.0, [_turn(calls=[_obs("Kalo Mirtan", "tool_parse_error")])], facts=FACTS)
    assert fact_recall(e) == 0.0


def test_intermediate_fact_advantages():
    # reward = outcome + 0.5 * recall: P 1.5, Q 0.25, R 0; mean 1.75 / 3
    adv, m = _adv("intermediate_fact", _fact_group(), estimator="dr_grpo")
    mean = 1.75 / 3
    assert adv == [_approx([1.5 - mean] * 3), _approx([0.25 - mean] * 2), _approx([-mean])]
    assert m["reward/fact_recall"] == pytest.approx(0.5)
    # a trajectory without facts: outcome only, and left out of the recall metric
    group = [*_fact_group(), _traj("S", 1.0, [_turn(text="Velton")])]
    adv, m = _adv("intermediate_fact", group, estimator="dr_grpo")
    mean = (1.5 + 0.25 + 0 + 1) / 4
    assert [a[0] for a in adv] == pytest.approx([1.5 - mean, 0.25 - mean, -mean, 1 - mean])
    assert m["reward/fact_recall"] == pytest.approx(0.5)


def test_intermediate_fact_per_turn_crediting():
    # turn reward = outcome + 0.5 * (new facts) / 2:
    #   P [1.25, 1.25, 1.0], Q [0.25, 0.0], R [0.0]; one (g, agent) pool, mean 3.75 / 6 = 0.625
    adv, m = _adv("intermediate_fact_turn", _fact_group(), estimator="dr_grpo")
    assert needs("intermediate_fact_turn") == ("facts",)
    assert adv == [_approx([0.625, 0.625, 0.375]), _approx([-0.375, -0.625]),
                   _approx([-0.625])]
    # recall P 1, Q 0.5, R 0; the pool's turn rewards: mean 0.625, deviations 0.625 (x4),
    # 0.375 (x2) in size
    assert m["reward/fact_recall"] == pytest.approx(0.5)
    assert m["reward/agent_mean"] == pytest.approx(0.625)
    assert m["reward/agent_std"] == pytest.approx(math.sqrt((4 * 0.625**2 + 2 * 0.375**2) / 6))


# -- exclusion -------------------------------------------------------------------------------

def test_env_failures_and_max_turns_exclusion():
    base = _c_grpo_group()
    env = _react("F", 1.0, [_obs("Error: search backend timed out", "search_error")],
                 "Marburg", "search_error")
    judge = _react("J", 1.0, [_obs(FOUND)], "Marburg")
    judge.rewards.clear()
    judge.add_label("judge_error")
    for name in MANAGERS:
        ref, _ = _adv(name, base, estimator="dr_grpo")
        adv, m = _adv(name, [*base, env, judge], estimator="dr_grpo")
        assert adv[:5] == ref, name                      # not in the group statistics
        assert adv[5:] == [[None, None], [None, None]], name
        assert m["adv/excluded_fraction"] == pytest.approx(2 / 7)
    # max_turns: stays in the statistics, out of the loss with the switch
    capped = _c_grpo_group()
    capped[0].add_label("max_turns")
    adv, m = _adv("c_grpo", capped, estimator="dr_grpo",
                             exclude_max_turns_from_loss=True)
    assert adv[0] == [None, None] and adv[4] == _approx([0.1])
    assert m["adv/masked_fraction"] == pytest.approx(1 / 5)
    assert m["adv/excluded_fraction"] == 0


# -- the registry ----------------------------------------------------------------------------

def _itersynth(uid: str, outcome: float, rubric: float, good: bool, *labels: str
               ) -> Trajectory:
    obs = FOUND if good else "Zorvex Dynamics is a software company."
    answer = "Marburg" if good else "Paris"
    turns = [_turn("planner", calls=[_obs(obs)], rubric=rubric),
             _turn("synthesizer", text=f"Notes: {obs}", rubric=rubric),
             _turn("planner", text=f"<answer>{answer}</answer>", rubric=rubric)]
    return _traj(uid, outcome, turns, *labels, answer=answer, facts=["Kalo Mirtan"])


def _react_shaped(uid: str, outcome: float, good: bool, *labels: str) -> Trajectory:
    obs = FOUND if good else "Zorvex Dynamics is a software company."
    answer = "Marburg" if good else "Paris"
    turns = [_turn(calls=[_obs(obs)]), _turn(text=f"<answer>{answer}</answer>")]
    return _traj(uid, outcome, turns, *labels, answer=answer, facts=["Kalo Mirtan"])


@pytest.mark.parametrize("name", MANAGERS)
def test_every_manager_on_both_shapes(name):
    itersynth = [_itersynth("i0", 1.0, 0.9, True), _itersynth("i1", 0.0, 0.1, False),
                 _itersynth("i2", 1.0, 0.9, True, "visit_error")]
    react = [_react_shaped("r0", 1.0, True), _react_shaped("r1", 0.0, False),
             _react_shaped("r2", 0.0, False, "overlong")]
    for group, roles in ((itersynth, ("planner", "synthesizer")), (react, ("agent",))):
        adv, m = _adv(name, group)
        assert [len(a) for a in adv] == [len(t.turns) for t in group]
        # the good trajectory is better on every reward part: positive on every turn
        assert all(a > 0 for a in adv[0]) and all(a < 0 for a in adv[1]), (name, adv)
        assert adv[2] == [None] * len(group[2].turns)
        assert {f"reward/{r}_{s}" for r in roles for s in ("mean", "std")} <= set(m)
        assert all(math.isfinite(v) for v in m.values())


def test_grpo_is_end_to_end():
    group = _c_grpo_group()
    adv, _ = _adv("grpo", group, estimator="rloo")
    assert adv == _adv("end_to_end", group, estimator="rloo")[0]
    # GRPO (unbiased std): outcomes [1, 1, 0, 0, 1], mean 0.6, std sqrt(1.2 / 4)
    assert [a[0] for a in adv] != [a[0] for a in _adv("grpo", group)[0]]
    s = math.sqrt(1.2 / 4) + 1e-6
    assert [a[0] for a in _adv("grpo", group)[0]] == pytest.approx(
        [0.4 / s, 0.4 / s, -0.6 / s, -0.6 / s, 0.4 / s])


def test_rdpo_and_mixed_differ():
    # w_outcome 1, w_rubric 0.5; t1 outcome 1: planner 1.4, synthesizer 1.3;
    #                            t2 outcome 0: planner 0.2, synthesizer 0.0 (no rubric)
    t1 = _traj("t1", 1.0, [_turn("planner", rubric=0.8), _turn("synthesizer", rubric=0.6)])
    t2 = _traj("t2", 0.0, [_turn("planner", rubric=0.4), _turn("synthesizer")])
    kw = {"estimator": "dr_grpo", "rubric_weight": 0.5}
    # role pools: planner mean 0.8, synthesizer mean 0.65
    adv, m = _adv("rdpo", [t1, t2], **kw)
    assert adv == [_approx([0.6, 0.65]), _approx([-0.6, -0.65])]
    assert (m["reward/planner_mean"], m["reward/planner_std"]) == pytest.approx((0.8, 0.6))
    assert (m["reward/synthesizer_mean"], m["reward/synthesizer_std"]) == pytest.approx(
        (0.65, 0.65))
    # one pool [1.4, 1.3, 0.2, 0.0], mean 0.725
    mixed, _ = _adv("rdpo_mixed", [t1, t2], **kw)
    assert mixed == [_approx([0.675, 0.575]), _approx([-0.525, -0.725])]
    # outcome only: both pools [1, 0]
    assert _adv("pipeline_outcome", [t1, t2], **kw)[0] == [[0.5, 0.5], [-0.5, -0.5]]


def test_unknown_manager():
    with pytest.raises(ValueError, match="rl.reward_manager='ppo': unknown reward_manager; "
                                         "one of c_grpo, .*rdpo_mixed, or an import path"):
        _adv("ppo", _c_grpo_group())


def test_world_questions_carry_their_bridge_facts():
    world = generate_world(300, seed=0)
    qs = world.questions(12, seed=3)
    assert len({q.kind for q in qs}) == 6
    for q in qs:
        # the bridge entities are the pages after the first, in hop order
        assert q.facts and [world.url(f) for f in q.facts] == list(q.support[1:]), q
        assert q.answer not in q.facts and not any(f in q.question for f in q.facts)
        assert q.to_dict()["facts"] == list(q.facts)


def test_rl_batch_keeps_each_turns_advantage_with_the_trajectory():
    """The trainer's batch step records the advantages it trained on per turn (None: out of
    the loss, e.g. a max-turns episode with the switch on) for the dump and the viewer."""
    from megatron_rl.config.schema import RLConfig
    from megatron_rl.trainer.batching import rl_batch

    group = _c_grpo_group()
    group[0].add_label("max_turns")
    batch, _ = rl_batch(group, RLConfig(reward_manager="grpo", exclude_max_turns_from_loss=True),
                        seq_length=16, rows_multiple=1)
    assert batch is not None
    assert group[0].metadata["turn_advantages"] == [None, None]
    assert all(isinstance(a, float) for t in group[1:] for a in t.metadata["turn_advantages"])
    assert group[2].metadata["turn_advantages"][0] < 0 < group[1].metadata["turn_advantages"][0]
