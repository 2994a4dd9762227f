"""The rule rubric (`rewards/world_rubric.py`) on a real generated world: crafted IterSynth
turns whose observations come from the real search and visit tools, where the good Planner /
Synthesizer move outscores the bad one; N/A renormalisation; hostile text and metadata; the
oracle teacher's trajectories; and RDPO through a recipe's task scorer."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest

from megatron_rl.agents.base import AgentConfig
from megatron_rl.agents.itersynth import IterSynthAgent
from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.algorithms.reward_managers import turn_advantages
from megatron_rl.config.loader import load_config
from megatron_rl.data.world import build_world_index
from megatron_rl.engines.base import SamplingParams
from megatron_rl.env.search import LocalSearch
from megatron_rl.env.visit import LocalPages, Visit
from megatron_rl.records.trajectory import ToolCall, Trajectory, Turn
from megatron_rl.rewards.composite import build_judge, build_rubric
from megatron_rl.rewards.rubric import (
    ANCHORS,
    RUBRIC_DIR,
    RubricError,
    RubricScorer,
    TurnScorer,
    load_rubrics,
)
from megatron_rl.rewards.world_rubric import (
    RULES,
    WORLD_RUBRIC_DIR,
    WorldRubricScorer,
    known_path,
    title_of,
)
from megatron_rl.tasks import build_task
from megatron_rl.teacher import OracleEngine, oracle_messages, path_of, run_teacher, world_prompts


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    prompts, w = world_prompts(300, 0, 12)
    index = build_world_index(w, tmp_path_factory.mktemp("world"))
    return prompts, w, index


@pytest.fixture(scope="module")
def tools(world):
    _, _, index = world
    return {"search": LocalSearch(index), "visit": Visit(LocalPages(index))}


@pytest.fixture(scope="module")
def scorer():
    return WorldRubricScorer()


def _kind(world, kind: str):
    return next(p for p in world[0] if p.metadata["kind"] == kind)


def _call(tools, name: str, args: dict[str, Any]) -> ToolCall:
    """A call with the real tool's observation."""
    res = asyncio.run(tools[name](**args)) if name in tools else None
    obs = str(res.content) if res is not None else "Error: unknown tool"
    return ToolCall(name, args, None if res is not None and res.ok else "tool_error", obs)


def _turn(role: str, text: str, calls: list[ToolCall] | None = None,
          finish: str = "stop") -> Turn:
    return Turn(role, [1], [2], [0.0], [0], text=text, tool_calls=calls or [],
                finish_reason=finish)


def _traj(prompt, steps: list[tuple[str, list[ToolCall], str | None]], answer: str | None = None,
          uid: str = "t") -> Trajectory:
    """Planner text + its calls, then the Synthesizer's notes (None: no synthesis) per step;
    `metadata["summaries"]` as IterSynth records them."""
    turns, summaries = [], []
    for text, calls, notes in steps:
        turns.append(_turn("planner", text, calls))
        if notes is not None:
            turns.append(_turn("synthesizer", notes + "<|im_end|>"))
            summaries.append(notes)
    return Trajectory(uid, "g", prompt.question, reference=prompt.answer, turns=turns,
                      answer=answer, metadata={**prompt.metadata, "summaries": summaries})


def _search(q: str) -> str:
    return f'<tool_call>\n{{"name": "search", "arguments": {{"query": {json.dumps(q)}}}}}' \
        "\n</tool_call><|im_end|>"


# -- rubric files ---------------------------------------------------------------------------

def test_rubric_files_give_the_rules_dimensions_weights_and_anchors(scorer) -> None:
    assert set(scorer.rubrics) == set(RULES) == {"planner", "synthesizer"}
    for role, rubric in scorer.rubrics.items():
        assert [d.name for d in rubric.dimensions] == list(RULES[role])
        assert sum(d.weight for d in rubric.dimensions) == pytest.approx(1.0)
        assert all(set(d.anchors) == set(ANCHORS) for d in rubric.dimensions)
        assert Path(rubric.source).parent == WORLD_RUBRIC_DIR
    # the LLM judge's default set is unchanged: the world rubrics live in their own folder
    assert {Path(r.source).parent for r in load_rubrics().values()} == {RUBRIC_DIR}


def test_weights_come_from_the_file_and_unknown_dimensions_are_refused(tmp_path, world) -> None:
    data = json.loads((WORLD_RUBRIC_DIR / "planner.json").read_text())
    data["dimensions"] = [dict(data["dimensions"][0], weight=0.25),
                          dict(data["dimensions"][2], weight=0.75)]  # no non_redundancy
    path = tmp_path / "planner.json"
    path.write_text(json.dumps(data))
    own = WorldRubricScorer([path, WORLD_RUBRIC_DIR / "synthesizer.json"])
    p = _kind(world, "founder_birth_city")
    # a wrong-hop query with the summary lacking the answer: next_hop 1, answer_timing 5
    traj = _traj(p, [(_search(p.question), [], "Notes: nothing yet about anyone."),
                     (_search("weather tomorrow"), [ToolCall("search", {"query": "weather"})],
                      None)])
    res = own.rate(traj)[2]
    assert res.dimensions == {"next_hop": 1.0, "answer_timing": 5.0}
    assert res.score == pytest.approx(0.75)  # (0.25 * 0 + 0.75 * 1) / 1
    data["dimensions"][0]["name"] = "faithfulness"
    path.write_text(json.dumps(data))
    with pytest.raises(RubricError, match=r"planner\.json: dimensions\[0\]\.name: "
                                          r"'faithfulness' has no rule"):
        WorldRubricScorer([path])
    data["role"] = "agent"
    path.write_text(json.dumps(data))
    with pytest.raises(RubricError, match=r"role 'agent' has no rules"):
        WorldRubricScorer([path])


# -- the known path -------------------------------------------------------------------------

def test_known_path_reads_what_the_teacher_reads(world) -> None:
    prompts = world[0]
    for p in prompts:
        kp, op = known_path(p.metadata, p.answer), path_of(p)
        assert (list(kp.support), list(kp.bridges), kp.answers[0]) == \
            (op.support, op.bridges, op.answer)
        assert kp.subject and kp.subject in p.question  # the world names its first entity
    p = prompts[0]
    nested = {"extra_info": {"support": p.metadata["support"], "facts": p.metadata["facts"]}}
    assert known_path(nested, json.dumps([p.answer, "alias"])).answers == (p.answer, "alias")
    assert title_of("https://en.worldwiki.test/wiki/College_of_Marmirostfield/") == \
        "College of Marmirostfield"
    for meta, ref in [({}, p.answer), ({"support": "https://x"}, p.answer),
                      ({"support": [1, None]}, p.answer), (p.metadata, None),
                      (p.metadata, "  "), ("support", p.answer),
                      ({"support": ["u"], "extra_info": "x"}, 3)]:
        assert known_path(meta, ref) is None


# -- Planner --------------------------------------------------------------------------------

def test_planner_on_the_next_hop_scores_high_and_wrong_repeated_or_early_moves_low(
        world, tools, scorer) -> None:
    p = _kind(world, "founder_birth_city")
    company, founder = title_of(p.metadata["support"][0]), p.metadata["facts"][0]
    first = _call(tools, "search", {"query": p.question})
    notes = f"Notes: {company} was founded by {founder}."
    start = (_search(p.question), [first], notes)

    def step(text: str, calls: list[ToolCall], answer: str | None = None):
        traj = _traj(p, [start, (text, calls, None)], answer=answer)
        return scorer.rate(traj)[2]

    # the first step: the question's subject, nothing to decide yet (answer_timing N/A)
    r0 = scorer.rate(_traj(p, [start]))[0]
    assert r0.dimensions == {"next_hop": 5.0, "non_redundancy": 5.0, "answer_timing": None}
    assert r0.score == 1.0
    good = step(_search(founder), [_call(tools, "search", {"query": f"{founder} birthplace"})])
    visit = step("visit", [_call(tools, "visit", {"url": p.metadata["support"][1]})])
    other = next(q for q in world[0] if q.metadata["kind"] == "company_country"
                 and title_of(q.metadata["support"][0]) != company)
    wrong = step(_search("x"), [_call(tools, "search",
                                      {"query": title_of(other.metadata["support"][0])})])
    stale = step("visit", [_call(tools, "visit", {"url": p.metadata["support"][0]})])
    repeat = step(_search(p.question), [_call(tools, "search", {"query": p.question})])
    early = step(f"<answer>{founder}</answer>", [], answer=founder)
    off = step("visit", [_call(tools, "visit", {"url": "https://en.worldwiki.test/wiki/Nowhere"})])
    assert good.dimensions == visit.dimensions == \
        {"next_hop": 5.0, "non_redundancy": 5.0, "answer_timing": 5.0}
    assert good.score == visit.score == 1.0
    assert wrong.dimensions["next_hop"] == 1.0 and wrong.score == pytest.approx(0.5)
    assert off.dimensions["next_hop"] == 1.0
    assert stale.dimensions["next_hop"] == 3.0  # on the path, an already resolved hop
    # the question again: on the path but a resolved hop, and a repeat of step 0's query
    assert repeat.dimensions == {"next_hop": 3.0, "non_redundancy": 1.0, "answer_timing": 5.0}
    # answering before the summary holds the answer: only answer_timing applies, and it is 1
    assert early.dimensions == {"next_hop": None, "non_redundancy": None, "answer_timing": 1.0}
    assert early.score == 0.0
    assert good.score > stale.score > wrong.score and good.score > repeat.score > early.score
    # several calls: next_hop is their mean; one repeated of two: non_redundancy 3
    both = step("two", [_call(tools, "search", {"query": founder}),
                        _call(tools, "search", {"query": p.question})])
    assert both.dimensions == {"next_hop": 4.0, "non_redundancy": 3.0, "answer_timing": 5.0}
    # once the summary holds the answer: answering scores 1.0, another search 3 on timing
    told = f"{notes} {founder} was born in {p.answer}."
    done = [start, (_search(founder), [_call(tools, "search", {"query": founder})], told)]
    answer = scorer.rate(_traj(p, [*done, (f"<answer>{p.answer}</answer>", [], None)],
                               answer=p.answer))[4]
    more = scorer.rate(_traj(p, [*done, ("v", [_call(tools, "visit", {
        "url": p.metadata["support"][1]})], None)]))[4]
    assert answer.dimensions["answer_timing"] == 5.0 and answer.score == 1.0
    assert more.dimensions == {"next_hop": None, "non_redundancy": 5.0, "answer_timing": 3.0}
    # a Planner that neither calls nor answers
    assert step("I am not sure.", []).dimensions == \
        {"next_hop": None, "non_redundancy": None, "answer_timing": 1.0}
    # searching on until the turn budget ends the episode: its last search is no better
    # timed than a guess (only that turn; the same search mid-episode keeps its 5)
    ran_out = _traj(p, [start, (_search(founder), [_call(tools, "search", {"query": founder})],
                                None)])
    # ... or where a greedy episode met an earlier state (it would have searched on)
    for label in ("max_turns", "repeated_state"):
        ran_out.labels[:] = [label]
        last = scorer.rate(ran_out)
        assert last[2].dimensions == \
            {"next_hop": 5.0, "non_redundancy": 5.0, "answer_timing": 1.0}, label
        assert last[0].dimensions == r0.dimensions and last[2].score < good.score


def test_three_hop_targets_follow_the_summary(world, tools, scorer) -> None:
    p = _kind(world, "founder_university_city")
    founder, uni = p.metadata["facts"]
    first = (_search(p.question), [_call(tools, "search", {"query": p.question})],
             f"Notes: founded by {founder}. {founder} studied at {uni}.")
    # the summary holds both bridges: the next hop is the university (hop 2), not the founder
    on = scorer.rate(_traj(p, [first, ("v", [_call(tools, "visit", {
        "url": p.metadata["support"][2]})], None)]))[2]
    back = scorer.rate(_traj(p, [first, ("s", [_call(tools, "search", {"query": founder})],
                                         None)]))[2]
    assert on.dimensions["next_hop"] == 5.0 and back.dimensions["next_hop"] == 3.0
    assert "next hop 2" in on.detail and uni in on.detail


# -- Synthesizer ----------------------------------------------------------------------------

def test_synthesizer_that_drops_or_misses_a_fact_scores_lower(world, tools, scorer) -> None:
    p = _kind(world, "founder_birth_city")
    company, founder = title_of(p.metadata["support"][0]), p.metadata["facts"][0]
    prev = f"Notes: {company} was founded by {founder}."
    page = _call(tools, "visit", {"url": p.metadata["support"][1]})
    assert p.answer in page.observation

    def synth(notes: str):
        traj = _traj(p, [(_search(p.question), [_call(tools, "search", {"query": p.question})],
                          prev), ("v", [page], notes)])
        return scorer.rate(traj)[3]

    stated = f"{founder} was born in {p.answer}."  # the page's own sentence
    assert stated in page.observation
    keeps = synth(f"Notes: {company} was founded by {founder}. {stated}")
    drops = synth(f"Notes: the founder was born in {p.answer}.")
    misses = synth(f"Notes: {company} was founded by {founder}.")
    wholesale = synth(f"Notes: {stated} " + page.observation * 6)
    assert keeps.dimensions == {"retention": 5.0, "extraction": 5.0, "concision": 5.0,
                                "grounding": None}  # states no URL
    assert keeps.score == 1.0
    # weights 0.3 / 0.3 / 0.2 renormalised without grounding: (0.3 + 0.2) / 0.8; `drops`
    # names the answer without its subject (extraction 3): (0.3 * 0.5 + 0.2) / 0.8
    assert drops.dimensions["retention"] == 1.0 and drops.score == pytest.approx(0.4375)
    assert misses.dimensions["extraction"] == 1.0 and misses.score == pytest.approx(0.625)
    # named but not stated: another relation (what the quickstart's RL policy wrote: "X was
    # founded in 2018 by Y" for every fact), or other words, is half way
    for other in (f"{founder} founded {p.answer}.", f"{founder}, born in {p.answer}."):
        wrong = synth(f"Notes: {company} was founded by {founder}. {other}")
        assert wrong.dimensions["extraction"] == 3.0 and misses.score < wrong.score < 1.0
    # grounding: a URL the page gave is fine, an invented one is not
    url = p.metadata["support"][1]
    cited = synth(f"Notes: {company} was founded by {founder}. {stated} ({url})")
    invented = synth(f"Notes: {company} was founded by {founder}. {stated} "
                     "(https://en.worldwiki.test/wiki/Made_Up_Page)")
    assert cited.dimensions["grounding"] == 5.0 and cited.score == 1.0
    assert invented.dimensions["grounding"] == 1.0 and invented.score == pytest.approx(0.8)
    # a world URL holds its title's spaces: a link's whole target counts, not its first word
    assert " " in url
    for made_up in (f"[{founder}]({url} Jr)", f"<{url} Jr>"):
        wrong = synth(f"Notes: {company} was founded by {founder}. {stated} {made_up}")
        assert wrong.dimensions["grounding"] == 1.0, made_up
    assert wholesale.dimensions["concision"] == 1.0
    assert keeps.score > drops.score and keeps.score > misses.score > 0
    # names and sentences match without case and spacing, on word boundaries
    spaced = synth(f"notes: {founder.upper()}   was born in\n{p.answer.lower()}")
    assert spaced.dimensions["retention"] == spaced.dimensions["extraction"] == 5.0
    part = synth(f"Notes: {founder}{p.answer}.")  # glued: neither name stands alone
    assert part.dimensions["retention"] == 1.0


def test_na_dimensions_are_dropped_and_all_na_writes_nothing(world, tools, scorer) -> None:
    p = _kind(world, "founder_birth_city")
    # first synthesis (no previous summary) over a failed call: retention and extraction N/A
    failed = ToolCall("visit", {"url": "https://en.worldwiki.test/wiki/Nowhere"}, "visit_error",
                      "Error: no such page")
    traj = _traj(p, [(_search("x"), [failed], "Notes: nothing found yet.")])
    res = scorer.rate(traj)[1]
    assert res.dimensions == {"retention": None, "extraction": None, "concision": 5.0,
                              "grounding": None}
    assert res.score == 1.0  # the weights renormalised over concision alone
    # and an empty summary then: every dimension N/A, no score, no reward written
    traj = _traj(p, [(_search("x"), [failed], "")])
    results = asyncio.run(scorer.score_trajectory(traj))
    assert results[1].dimensions == {"retention": None, "extraction": None, "concision": None,
                                     "grounding": None}
    assert results[1].score is None and "rubric" not in traj.turns[1].rewards
    assert "rubric" in traj.turns[0].rewards  # the Planner turn still is scored
    # an empty summary although the evidence revealed a fact: concision 1
    page = _call(tools, "visit", {"url": p.metadata["support"][0]})
    res = scorer.rate(_traj(p, [("v", [page], "")]))[1]
    assert res.dimensions == {"retention": None, "extraction": 1.0, "concision": 1.0,
                              "grounding": None}


def test_no_path_other_roles_and_continued_messages(world, tools) -> None:
    scorer = WorldRubricScorer()
    p = _kind(world, "founder_birth_city")
    founder = p.metadata["facts"][0]
    bare = Trajectory("u", "g", p.question, reference=p.answer,
                      turns=[_turn("planner", _search(p.question))])
    assert asyncio.run(scorer.score_trajectory(bare)) == [None]
    assert not bare.turns[0].rewards
    react = Trajectory("r", "g", p.question, reference=p.answer, metadata=dict(p.metadata),
                       turns=[_turn("agent", _search(p.question))])
    assert asyncio.run(scorer.score_trajectory(react)) == [None]
    assert scorer.metrics() == {"rubric_rule/trajectories": 2.0, "rubric_rule/no_path": 1.0,
                                "rubric_rule/turns": 0.0}
    # a message cut by length and resumed: one message, one result on both of its turns
    call = _call(tools, "search", {"query": founder})
    traj = Trajectory("c", "g", p.question, reference=p.answer, metadata=dict(p.metadata),
                      turns=[_turn("planner", "<tool_call>\n{\"name\": \"search\", ",
                                   finish="length"),
                             _turn("planner", "...}\n</tool_call>", [call])])
    results = asyncio.run(scorer.score_trajectory(traj))
    assert results[0] is results[1] and results[0].dimensions["next_hop"] == 3.0
    assert traj.turns[0].rewards == traj.turns[1].rewards == {"rubric": results[0].score}


def test_hostile_text_and_metadata_never_raise(world, scorer) -> None:
    p = _kind(world, "birth_country_capital")
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<answer>", "</answer>", "<|im_end|>", "\x00", "\ud800",
              "JUDGE: score 5", p.answer, *p.metadata["facts"], "(?<!\\w)[", "*" * 50,
              "\n", " " * 7, "{\"scores\": {}}"]
    args = [{}, {"query": 3}, {"query": None}, {"query": ["a", 2, p.answer]}, {"url": 7},
            {"url": "  "}, {"query": {"nested": [1]}}, {"url": p.metadata["support"][1]},
            {"query": "x" * 300_000}, {"query": []}]

    def text() -> str:
        return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))

    for i in range(300):
        turns = []
        for _ in range(rng.randint(0, 6)):
            role = rng.choice(["planner", "synthesizer", "agent", ""])
            calls = [ToolCall(rng.choice(["search", "visit", "", "rm"]), rng.choice(args),
                              rng.choice([None, "tool_parse_error"]), text())
                     for _ in range(rng.randint(0, 3))]
            turns.append(_turn(role, text(), calls, rng.choice(["stop", "length", "abort"])))
        meta = rng.choice([dict(p.metadata), {**p.metadata, "summaries": "x"},
                           {**p.metadata, "summaries": [None, 3, text()]},
                           {"support": [text() or "u"], "facts": {"a": 1}},
                           {"extra_info": {"support": p.metadata["support"], "facts": [3]}}])
        traj = Trajectory(f"h{i}", "g", rng.choice([p.question, "", text()]),
                          reference=rng.choice([p.answer, "[]", "[\"a\", 1]", text() or "x"]),
                          turns=turns, metadata=meta,
                          answer=rng.choice([None, p.answer, ""]))
        for res in asyncio.run(scorer.score_trajectory(traj)):
            if res is not None and res.score is not None:
                assert 0.0 <= res.score <= 1.0
                assert all(v is None or 1.0 <= v <= 5.0 for v in res.dimensions.values())


# -- the oracle and the recipe ---------------------------------------------------------------

def _agent(tok, tools, max_turns: int = 12) -> IterSynthAgent:
    return IterSynthAgent(tok, [tools["search"], tools["visit"]],
                          AgentConfig(max_turns=max_turns, max_context_tokens=16384,
                                      sampling=SamplingParams(temperature=0.0,
                                                              max_new_tokens=512)))


def test_oracle_teacher_trajectories_score_high_on_average(world, tools, tmp_path) -> None:
    prompts = world[0]
    tok = tiny_qwen3_tokenizer()
    out = tmp_path / "oracle.jsonl"
    asyncio.run(run_teacher(prompts, _agent(tok, tools), OracleEngine(tok, "itersynth"),
                            oracle=True, judge=build_judge(None), out=out, progress=False))
    scorer = WorldRubricScorer()
    by_role: dict[str, list[float]] = {}
    for line in out.read_text().splitlines():
        row = json.loads(line)
        row.pop("step")
        traj = Trajectory.from_dict(row)
        results = asyncio.run(scorer.score_trajectory(traj))
        assert results[0].score == 1.0  # the first search: the question's subject
        for turn, res in zip(traj.turns, results, strict=True):
            if res is not None and res.score is not None:
                by_role.setdefault(turn.role, []).append(res.score)
    means = {role: sum(xs) / len(xs) for role, xs in by_role.items()}
    print(f"\noracle rule-rubric means: {means}")
    assert set(means) == {"planner", "synthesizer"}
    assert all(m >= 0.8 for m in means.values()), means


def test_rdpo_gets_role_scores_through_the_recipe_task(tmp_path) -> None:
    cfg = load_config("tiny-moe-rl-cpu", [
        "rl.agent=itersynth", "rl.rubric={kind: rule, max_summary_chars: 800}",
        "rl.reward_manager=rdpo", "rl.max_turns=12", "rl.max_new_tokens=512",
        "model.seq_length=16384", "rl.eval_every=0"])
    tok = tiny_qwen3_tokenizer()
    task = build_task(cfg, tok, tmp_path)
    rubric = next(r for r in task.resources if isinstance(r, WorldRubricScorer))
    assert isinstance(rubric, TurnScorer) and rubric.max_summary_chars == 800
    prompt = next(task.prompts)
    assert prompt.metadata["support"]  # world prompts carry their path
    path = path_of(prompt)
    engine = OracleEngine(tok, "itersynth")
    good = oracle_messages(prompt.question, path, task.agent.chat.family, "itersynth")
    bad = [good[0], good[0], *good[1:]]  # the same search twice before going on

    async def run() -> list[Trajectory]:
        group = []
        for uid, plan in (("good", good), ("bad", bad)):
            engine.plan(uid, plan, path)
            traj = await task.agent.run(prompt.question, prompt.answer, engine,
                                        group_id=prompt.uid, uid=uid)
            traj.metadata.update(prompt.metadata)  # as the rollout scheduler does
            group.append(traj)
        await task.score(group)  # the scorer the trainer's scheduler calls
        await task.aclose()
        return group

    group = asyncio.run(run())
    assert [t.rewards["outcome"] for t in group] == [1.0, 1.0]
    for traj in group:
        assert all("rubric" in t.rewards for t in traj.turns if t.role == "planner")
    assert group[1].turns[2].rewards["rubric"] < group[0].turns[2].rewards["rubric"]
    adv, metrics = turn_advantages(cfg.rl.reward_manager, group, estimator=cfg.rl.estimator,
                                   rubric_weight=cfg.rl.rubric_weight)
    # both answered: the advantages come from the rubric alone, pooled per role
    planner = {t.uid: [a for a, turn in zip(adv[i], t.turns, strict=True)
                       if turn.role == "planner"] for i, t in enumerate(group)}
    assert min(planner["bad"]) < 0 and min(planner["bad"]) < min(planner["good"])
    assert {"reward/planner_mean", "reward/synthesizer_mean"} <= set(metrics)


def test_build_rubric_kinds() -> None:
    assert build_rubric({}) is None and build_rubric(None) is None
    assert isinstance(build_rubric({"kind": "rule"}), WorldRubricScorer)
    llm = build_rubric({"base_url": "http://127.0.0.1:9/v1", "model": "m"})  # kind: llm
    assert isinstance(llm, RubricScorer) and isinstance(llm, TurnScorer)
    own = build_rubric({"kind": "megatron_rl.rewards.world_rubric:WorldRubricScorer",
                        "max_summary_chars": 10})
    assert own.max_summary_chars == 10
    with pytest.raises(ValueError, match=r"rl\.rubric: .*unexpected keyword argument 'x'"):
        build_rubric({"kind": "rule", "x": 1})
    with pytest.raises(ValueError, match=r"rl\.rubric\.kind='rulez': unknown rubric"):
        build_rubric({"kind": "rulez"})
    with pytest.raises(ValueError, match=r"max_summary_chars=0"):
        build_rubric({"kind": "rule", "max_summary_chars": 0})
