"""Plug-in registries: a recipe names a user's own agent, task, tool, judge, reward manager or
engine by import path (a module written outside the package, in a temp folder on sys.path);
the config's choices come from the registries; and `megatron-rl train` runs a user's task,
agent and reward manager end to end."""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest

import megatron_rl.tasks  # noqa: F401  (creates every role's registry)
from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.algorithms.reward_managers import turn_advantages
from megatron_rl.config.loader import ConfigError, load_config
from megatron_rl.engines.kinds import EngineSpec
from megatron_rl.records.trajectory import Trajectory, Turn
from megatron_rl.rewards.composite import build_judge
from megatron_rl.tasks import TASKS, build_task
from megatron_rl.train import train
from megatron_rl.utils.registry import REGISTRIES
from tests.pools import get_pool

PLUGIN = '''
import sys

from megatron_rl.agents.one_message import OneMessageAgent
from megatron_rl.engines.kinds import EmbeddedKind
from megatron_rl.records.prompt import Prompt
from megatron_rl.tasks.base import Task, build_agents, cycle


class ShoutAgent(OneMessageAgent):
    role = "shouter"


def make_task(cfg, tokenizer, folder, aux_urls):
    async def score(group):  # reward: the share of tokens with an id below 100
        for t in group:
            ids = [i for turn in t.turns for i in turn.output_ids]
            t.rewards["outcome"] = sum(i < 100 for i in ids) / max(len(ids), 1)
    agent, eval_agent = build_agents(cfg, tokenizer, [])
    prompts = [Prompt(f"Say {w}.", "", f"p{i}") for i, w in enumerate(("hi", "yo", "ok"))]
    return Task(cycle(prompts, lambda p, uid: Prompt(p.question, p.answer, uid)), [], agent,
                eval_agent, score)


CALLS = []


def halve_grpo(trajectories, **kw):
    """Half the GRPO advantage on every turn."""
    from megatron_rl.algorithms.reward_managers import grpo

    CALLS.append(len(trajectories))
    adv, metrics = grpo(trajectories, **kw)
    return [[a / 2 if a is not None else None for a in t] for t in adv], {**metrics, "mine": 1.0}


class ConstJudge:
    def __init__(self, score=0.25):
        self.score = score

    async def judge(self, question, answer, reference):
        from megatron_rl.rewards.base import Verdict
        return Verdict(self.score, self.score > 0.5, None, "const")


def make_tool(ctx):
    from megatron_rl.env.search import LocalSearch
    tool = LocalSearch(ctx.index)
    tool.name = "my_search"
    return tool


class EchoKind(EmbeddedKind):
    def command(self, spec, host, port):
        return [sys.executable, "-c", "print('echo')"], {"ECHO": "1"}, None
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_plugins.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import my_plugins  # type: ignore[import-not-found]

    return importlib.reload(my_plugins)


def test_config_choices_come_from_the_registries():
    assert {"agent", "task", "tool", "judge", "reward_manager", "engine"} <= set(REGISTRIES)
    with pytest.raises(ConfigError, match=r"rl.agent='reactt': unknown agent \(did you mean "
                                          r"'react'\?\); one of itersynth, one_message, react"):
        load_config("tiny-moe-rl-cpu", ["rl.agent=reactt"])
    with pytest.raises(ConfigError, match=r"rl.tools\[1\]='vist'.*did you mean 'visit'"):
        load_config("tiny-moe-rl-cpu", ["rl.tools=[search, vist]"])
    with pytest.raises(ConfigError, match="rollout.engine='vllm': unknown engine"):
        load_config("tiny-moe-rl-cpu", ["rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="rl.reward_manager='ppo'"):
        load_config("tiny-moe-rl-cpu", ["rl.reward_manager=ppo"])
    # an import path passes the config; it is resolved (and checked) when built
    cfg = load_config("tiny-moe-rl-cpu", ["rl.agent=somewhere.else:Agent"])
    assert cfg.rl.agent == "somewhere.else:Agent"
    with pytest.raises(ValueError, match="rl.task='no_such_module:make': cannot import"):
        TASKS.get("no_such_module:make", "rl.task")


def test_every_role_resolves_a_plugin_by_import_path(plugin, tmp_path):
    tok = tiny_qwen3_tokenizer()
    # task + agent
    cfg = load_config("tiny-moe-rl-sanity-cpu", ["rl.task=my_plugins:make_task",
                                                 "rl.agent=my_plugins.ShoutAgent"])
    task = build_task(cfg, tok, tmp_path)
    assert type(task.agent).__name__ == "ShoutAgent" and task.agent.role == "shouter"
    assert next(task.prompts).question == "Say hi."
    # tools of the search task
    cfg = load_config("tiny-moe-rl-cpu", ["rl.world_docs=40", "rl.eval_every=0",
                                          "rl.tools=[search, 'my_plugins:make_tool']"])
    task = build_task(cfg, tok, tmp_path)
    assert list(task.agent.tools) == ["search", "my_search"]
    # judge
    judge = build_judge({"kind": "my_plugins:ConstJudge", "score": 0.75})
    assert asyncio.run(judge.judge("q", "a", "r")).score == 0.75
    with pytest.raises(ValueError, match="rl.judge:.*unexpected keyword argument 'nope'"):
        build_judge({"kind": "my_plugins:ConstJudge", "nope": 1})
    # reward manager
    turns = [Turn("agent", [1], [2], [0.0], [0])]
    group = [Trajectory(f"u{i}", "g", "q", "a", list(turns), rewards={"outcome": r})
             for i, r in enumerate((1.0, 0.0))]
    adv, metrics = turn_advantages("my_plugins:halve_grpo", group)
    ref, _ = turn_advantages("grpo", group)
    assert adv == [[a[0] / 2] for a in ref] and metrics["mine"] == 1.0
    # engine kind
    spec = EngineSpec(kind="my_plugins:EchoKind", random_init="tiny-moe")
    cmd, env, _ = spec.engine_kind().command(spec, "127.0.0.1", 1)
    assert cmd[-1] == "print('echo')" and env == {"ECHO": "1"}


def test_train_runs_a_plugin_task_agent_and_reward_manager(plugin, tmp_path):
    cfg = load_config("tiny-moe-rl-sanity-cpu", [
        "rl.task=my_plugins:make_task", "rl.agent=my_plugins:ShoutAgent",
        "rl.reward_manager=my_plugins:halve_grpo", "train.steps=2", "rl.eval_every=0",
        "parallel.ep=1", "rl.sampling.samples_per_prompt=4", f"train.output_dir={tmp_path}"])
    rows = train(cfg, get_pool(1))
    assert [r["mine"] for r in rows] == [1.0, 1.0]
    assert plugin.CALLS == [8, 8]  # 2 groups x 4 samples per step
    dumped = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert {turn["role"] for t in dumped for turn in t["turns"]} == {"shouter"}
    assert all(0 <= t["rewards"]["outcome"] <= 1 for t in dumped)
