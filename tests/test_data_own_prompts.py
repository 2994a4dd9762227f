"""A user's prompts as the model sees them: a template from `configs/prompts/agents/` (or a path)
renders each row's question into the first context (`data.prompt_template`), and a row's
`tools_kwargs` reach that row's tool calls (verl's per-sample tool arguments)."""

from __future__ import annotations

import asyncio
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.config.loader import ConfigError, load_config
from megatron_rl.config.prompt_template import TEMPLATE_DIR, load_template
from megatron_rl.data.parquet import DataError, read_prompts
from megatron_rl.env.build import BUILTIN_PARAMETERS
from megatron_rl.records.trajectory import Trajectory
from megatron_rl.rollout.scheduler import RolloutScheduler, SchedulerConfig
from megatron_rl.tasks import build_task
from tests.fakes import ScriptedEngine, build_index_cli, tool_call_text

CORPUS = [{"id": str(i), "url": f"https://w.test/p{i}", "title": f"Entity {i}",
           "text": f"Entity {i} was founded in {1900 + i} in the city of Velt{i % 3}."}
          for i in range(10)]
RUN = ["rl.eval_every=0", "model.seq_length=8192", "rl.max_new_tokens=256", "rl.max_turns=2"]


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return build_index_cli(tmp_path_factory.mktemp("corpus"), CORPUS)


def _rows(path, rows):
    pq.write_table(pa.Table.from_pylist([{
        "data_source": "own", "ability": "search",
        "prompt": [{"role": "system", "content": "DATA-SYSTEM-PROMPT"},
                   {"role": "user", "content": f"Where was entity {i} founded?"}],
        "reward_model": {"ground_truth": f"Velt{i % 3}"}, "extra_info": {"index": i},
        "tools_kwargs": json.dumps(kwargs)} for i, kwargs in enumerate(rows)]), path)
    return path


def _collect(task, n: int, policy) -> list[Trajectory]:
    engine = ScriptedEngine(task.agent.chat.tokenizer, policy)

    async def score(group: list[Trajectory]) -> None:
        for t in group:
            t.rewards["outcome"] = 0.0

    async def run():
        sched = RolloutScheduler(task.agent, engine, task.prompts, score, SchedulerConfig(
            samples_per_prompt=1, groups_per_step=n, dynamic_sampling=False))
        try:
            return (await sched.collect(step=0)).trajectories
        finally:
            await task.aclose()

    return sorted(asyncio.run(run()), key=lambda t: t.group_id)


def _answer(context: str) -> str:
    return "<answer>Velt0</answer>"


def test_a_template_renders_every_first_context(index, tmp_path):
    template = tmp_path / "mine.yaml"
    template.write_text("system: 'TEMPLATE-SYSTEM for {data_source} ({ability}); answer inside "
                        "<answer></answer>.'\nuser: |-\n  TEMPLATE-QUESTION: {question}\n"
                        "  Literal {{braces}}.\n")
    data = _rows(tmp_path / "train.parquet", [{}, {}])
    cfg = load_config("tiny-moe-rl-cpu", [*RUN, f"env.search.index={index}",
                                          f"data.train_files=[{data}]",
                                          f"data.prompt_template={template}"])
    task = build_task(cfg, tiny_qwen3_tokenizer(), tmp_path)
    trajs = _collect(task, 2, _answer)
    tok = task.agent.chat.tokenizer
    for i, t in enumerate(trajs):
        first = tok.decode(t.turns[0].context_ids)
        assert "TEMPLATE-SYSTEM for own (search)" in first
        assert f"TEMPLATE-QUESTION: Where was entity {i} founded?\nLiteral {{braces}}." in first
        assert "DATA-SYSTEM-PROMPT" not in first  # the template's system prompt replaced it
        assert t.answer == "Velt0"

    # a built-in template by name; without `system` the row's own system prompt stays
    cfg = load_config("tiny-moe-rl-cpu", [*RUN, f"env.search.index={index}",
                                          f"data.train_files=[{data}]",
                                          "data.prompt_template=question_only"])
    task = build_task(cfg, tiny_qwen3_tokenizer(), tmp_path)
    first = tok.decode(_collect(task, 1, _answer)[0].turns[0].context_ids)
    assert "DATA-SYSTEM-PROMPT" in first and "Where was entity 0 founded?" in first
    # the world's questions (no data files) through a template too
    cfg = load_config("tiny-moe-rl-cpu", [*RUN, "rl.world_docs=60",
                                          "data.prompt_template=deep_search"])
    task = build_task(cfg, tiny_qwen3_tokenizer(), tmp_path)
    first = tok.decode(_collect(task, 1, _answer)[0].turns[0].context_ids)
    assert load_template("deep_search").system in first and "Question: " in first


def test_every_shipped_template_loads():
    names = sorted(p.stem for p in TEMPLATE_DIR.glob("*.yaml"))
    assert {"deep_search", "question_only"} <= set(names)
    for name in names:
        load_config("tiny-moe-rl-cpu", [f"data.prompt_template={name}"])


@pytest.mark.parametrize(("text", "error"), [
    (None, r"data.prompt_template='.*nope.yaml': no template file .*nope.yaml \(templates in "),
    ("user: 'Q: {question} {answer}'", r"data.prompt_template=.*: unknown placeholder "
                                       r"\{answer\} in 'user' \(known: \{question\}"),
    ("user: 'Q: {question.__class__}'", r"unknown placeholder \{question.__class__\}"),
    ("user: 'no question here'", r"'user' must hold \{question\}"),
    ("system: 'Q: {question}'\nuser: '{question}'", r"\{question\} belongs in 'user'"),
    ("user: 'Q: {question'", r"'user' is not a template"),
    ("system: hi", r"'user' is required"),
    ("user: '{question}'\nassistant: x", r"unknown key\(s\) \['assistant'\]"),
])
def test_template_errors_name_the_field(tmp_path, text, error):
    path = tmp_path / "nope.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        load_config("tiny-moe-rl-cpu", [f"data.prompt_template={path}"])
    with pytest.raises(ConfigError, match=r"data.prompt_template='missing': no template file"):
        load_config("tiny-moe-rl-cpu", ["data.prompt_template=missing"])


def _search_then_answer(context: str) -> str:
    if "<tool_response>" in context:
        return "<answer>Velt0</answer>"
    return tool_call_text("search", query="Entity founded city Velt")  # no top_k: the default


def test_tools_kwargs_reach_the_tool_calls_of_their_row(index, tmp_path):
    data = _rows(tmp_path / "train.parquet", [
        {"search": {"top_k": 3}},                              # the project's layout
        {},                                                    # the tool's default (5)
        {"search": {"create_kwargs": {"ground_truth": "Velt2"},  # verl's layout
                    "execute_kwargs": {"top_k": 2}}, "visit": {}},
    ])
    cfg = load_config("tiny-moe-rl-cpu", [*RUN, f"env.search.index={index}",
                                          f"data.train_files=[{data}]"])
    task = build_task(cfg, tiny_qwen3_tokenizer(), tmp_path)
    trajs = _collect(task, 3, _search_then_answer)
    found = []
    for t in trajs:
        (call,) = t.turns[0].tool_calls
        assert call.error is None and "top_k" not in call.arguments  # the model gave none
        found.append(call.observation.splitlines()[0])
    assert found == ["A search for 'Entity founded city Velt' found 3 results:",
                     "A search for 'Entity founded city Velt' found 5 results:",
                     "A search for 'Entity founded city Velt' found 2 results:"]
    assert trajs[0].metadata["tool_arguments"] == {"search": {"top_k": 3}}


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"search": {"top_k": 100}}, r"row 0.tools_kwargs.search: argument 'top_k' must be <= 20, "
                                 r"got 100$"),
    ({"search": {"k": 3}}, r"row 0.tools_kwargs.search: unknown argument\(s\) \['k'\]"),
    ({"visit": {"goal": 7}}, r"row 0.tools_kwargs.visit: argument 'goal' must be string"),
    ({"search": [3]}, r"row 0.tools_kwargs.search: a mapping of argument → value, got list"),
    ({"search": {"execute_kwargs": {"top_k": 0}}},
     r"row 0.tools_kwargs.search.execute_kwargs: argument 'top_k' must be >= 1"),
    ({"search": {"create_kwargs": {}, "top_k": 3}},
     r"row 0.tools_kwargs.search: mixes verl's \['create_kwargs'\] with arguments \['top_k'\]"),
])
def test_tools_kwargs_are_checked_against_the_tools_at_load(tmp_path, kwargs, error):
    data = _rows(tmp_path / "bad.parquet", [kwargs])
    with pytest.raises(DataError, match=error):
        read_prompts([data], tool_parameters=BUILTIN_PARAMETERS)
