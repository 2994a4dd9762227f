"""IterSynth episodes (Planner / Synthesizer, summary as the only state) with a scripted policy."""

from __future__ import annotations

from megatron_rl.agents import IterSynthAgent
from megatron_rl.agents.itersynth import NO_NOTES
from megatron_rl.engines.base import SamplingParams
from megatron_rl.records.trajectory import Trajectory
from tests.fakes import PARIS
from tests.fakes import tool_call_text as call
from tests.test_agents_react import ANSWER, QUESTION, TOK, episode

NOTES_1 = "Search: Paris is a likely answer (https://en.wikipedia.org/wiki/Paris)."
NOTES_2 = "Paris is the capital of France (https://en.wikipedia.org/wiki/Paris)."
SCRIPT = [call("search", query="capital of France"), f"<think>keep Paris</think>{NOTES_1}",
          call("visit", url=PARIS), NOTES_2, ANSWER]


def itersynth(script: list[str], **config: object) -> Trajectory:
    return episode(script, agent_cls=IterSynthAgent, **config)[0]


def show(traj: Trajectory) -> str:
    return "\n".join(f"[{i}] {t.role:<11} {t.text!r}" for i, t in enumerate(traj.turns))


def test_planner_synthesizer_episode() -> None:
    traj = itersynth(SCRIPT)
    print("\n" + show(traj))
    assert traj.answer == "Paris" and traj.labels == []
    assert traj.roles == ["planner", "synthesizer"] * 2 + ["planner"]
    assert traj.metadata["summaries"] == [NOTES_1, NOTES_2]  # thinking is not carried
    # every turn starts a fresh prompt: one training sequence per turn
    seqs = traj.sequences()
    assert len(seqs) == 5
    assert [s.tokens for s in seqs] == [t.context_ids + t.output_ids for t in traj.turns]
    contexts = [TOK.decode(t.context_ids) for t in traj.turns]
    # the Planner sees the question and the notes, never pages; only it is offered tools
    assert [f"Notes so far:\n{m}<|im_end|>" in contexts[i]
            for i, m in ((0, NO_NOTES), (2, NOTES_1), (4, NOTES_2))] == [True] * 3
    assert all(f"Question: {QUESTION}" in c for c in contexts)
    assert all("# Tools" in c for c in contexts[::2])
    assert not any("# Tools" in c for c in contexts[1::2])
    assert "largest city" not in contexts[2] + contexts[4]
    # the Synthesizer sees M_t and this step's evidence, then the question (what to keep is
    # decided by it, so it stands next to where the notes are written)
    assert f"Current notes:\n{NOTES_1}" in contexts[3]
    assert contexts[3].endswith(f"</tool_response>\n\nQuestion: {QUESTION}<|im_end|>\n"
                                "<|im_start|>assistant\n")
    assert '[1] visit {"url": "https://en.wikipedia.org/wiki/Paris"}\n<tool_response>\nParis\n' \
           "Paris is the capital and largest city" in contexts[3]
    assert [c.name for c in traj.turns[2].tool_calls] == ["visit"]


def test_injected_evidence_does_not_reach_the_synthesizer_as_tokens() -> None:
    traj = itersynth([call("visit", url="https://evil.example"), NOTES_1, ANSWER])
    synth = traj.turns[1].context_ids
    im_start = TOK.convert_tokens_to_ids("<|im_start|>")
    assert synth.count(im_start) == 3  # system, user, assistant: nothing from the page
    assert TOK.convert_tokens_to_ids("<tool_call>") not in synth
    assert traj.answer == "Paris"


def test_synthesizer_may_not_act_and_keeps_the_old_notes() -> None:
    traj = itersynth([call("search", query="a"), NOTES_1, call("search", query="b"),
                      call("visit", url=PARIS), call("search", query="c"),
                      "<answer>Paris</answer>", ANSWER])
    assert traj.roles == ["planner", "synthesizer"] * 3 + ["planner"]
    assert [t.labels for t in traj.turns[1::2]] == [[], ["tool_parse_error"],
                                                    ["tool_parse_error"]]
    assert traj.metadata["summaries"] == [NOTES_1] * 3
    assert traj.turns[3].tool_calls == []  # a Synthesizer's call is never run
    assert traj.answer == "Paris" and traj.status == "tool_parse_error"


def test_max_steps_and_tool_errors() -> None:
    traj = itersynth([call("visit", url="https://nowhere.example"), NOTES_1,
                      call("search", query="a"), NOTES_2, call("search", query="b")], max_turns=3)
    assert traj.labels == ["visit_error", "max_turns"] and traj.answer is None
    assert traj.roles == ["planner", "synthesizer"] * 2 + ["planner"]
    assert "no page at https://nowhere.example" in TOK.decode(traj.turns[1].context_ids)


def test_no_action_planner_ends_the_episode() -> None:
    traj = itersynth(["I do not know."])
    assert traj.roles == ["planner"] and traj.answer is None and traj.labels == []



def test_without_tool_specs_the_planner_prompt_is_short_and_the_tools_still_run() -> None:
    """`tool_specs=False` (rl.tool_specs, --no-tool-specs): the schemas leave the system prompt,
    the episode is otherwise the same (the calls parse and run, the answer is right)."""
    with_specs, without = itersynth(SCRIPT), itersynth(SCRIPT, tool_specs=False)
    assert without.answer == "Paris" and without.roles == with_specs.roles
    assert [c.name for t in without.turns for c in t.tool_calls] == ["search", "visit"]
    planner = TOK.decode(without.turns[0].context_ids)
    assert "# Tools" not in planner and '"parameters"' not in planner
    assert f"Question: {QUESTION}" in planner
    saved = len(with_specs.turns[0].context_ids) - len(without.turns[0].context_ids)
    assert saved > 100, saved
    # the Synthesizer never had them
    assert without.turns[1].context_ids == with_specs.turns[1].context_ids


def test_greedy_notes_left_unchanged_are_decoded_once_more_with_sampling() -> None:
    """At temperature 0 a step whose notes did not change is repeated for the rest of the
    episode (the notes are the only state): `unstick_temperature` re-decodes them once."""
    script = [call("search", query="capital of France"), NOTES_1,
              call("visit", url=PARIS), NOTES_1, NOTES_2, ANSWER]
    sampling = SamplingParams(max_new_tokens=256, temperature=0.0)
    traj, engine = episode(script, agent_cls=IterSynthAgent, sampling=sampling,
                           unstick_temperature=0.7)
    assert traj.answer == "Paris" and traj.metadata["unstuck"] == 1
    assert traj.roles == ["planner", "synthesizer", "planner", "synthesizer", "synthesizer",
                          "planner"]
    assert traj.metadata["summaries"] == [NOTES_1, NOTES_2]
    assert [r.sampling.temperature for r in engine.requests] == [0.0] * 4 + [0.7, 0.0]
    assert engine.requests[4].input_ids == engine.requests[3].input_ids  # the same evidence
    # off by default, and never when the episode already samples
    for kwargs in ({"sampling": sampling}, {"unstick_temperature": 0.7}):
        plain = episode(script[:4] + script[5:], agent_cls=IterSynthAgent, **kwargs)[0]
        assert "unstuck" not in plain.metadata and plain.roles.count("synthesizer") == 2


def test_a_greedy_episode_that_meets_an_earlier_state_ends_there() -> None:
    """Greedy, the notes are the whole state: a Planner context seen before brings the same
    plan and notes again until the turn budget, so the episode ends at the repeat
    (`repeated_state`). Sampled, or with `stop_on_repeat=False`, it runs to the budget."""
    def policy(context: str) -> str:  # a function of the context, as greedy decoding is
        return NOTES_1 if "Rewrite the notes" in context else call("search", query="France")

    greedy = SamplingParams(max_new_tokens=256, temperature=0.0)
    traj, engine = episode(policy, agent_cls=IterSynthAgent, sampling=greedy, max_turns=6)
    assert traj.roles == ["planner", "synthesizer"] * 2 and traj.answer is None
    assert traj.labels == ["repeated_state"] and traj.turns[-1].labels == ["repeated_state"]
    assert traj.metadata["repeated_at_step"] == 2 and len(engine.requests) == 4
    assert engine.requests[2].input_ids != engine.requests[0].input_ids  # notes came in
    sampled = SamplingParams(max_new_tokens=256, temperature=0.7)
    for kwargs in ({"sampling": greedy, "stop_on_repeat": False}, {"sampling": sampled},
                   {"sampling": greedy, "unstick_temperature": 0.7}):
        full, engine = episode(policy, agent_cls=IterSynthAgent, max_turns=6, **kwargs)
        assert full.labels == ["max_turns"] and full.roles.count("planner") == 6, kwargs
        assert "repeated_at_step" not in full.metadata
