"""One config per component: a component's dataclass copies no schema default, the agent takes
`rl.agent_limits` as it is, `rl.judge.kind` / `rl.rubric.kind` are checked at load, and the
registry checks do not depend on what the process imported first."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import subprocess
import sys
from typing import Any

import pytest

from megatron_rl.agents.base import AgentConfig
from megatron_rl.config import schema
from megatron_rl.config.fields import ConfigError
from megatron_rl.config.loader import load_config
from megatron_rl.engines.base import SamplingParams

# packages whose components take a recipe section (the trainer's take the schema's classes;
# evaluation.EvalConfig holds the `eval` command's own flags, not a recipe's)
COMPONENTS = ("agents", "algorithms", "engines", "env", "rewards", "rollout", "tasks", "utils")
# look-alikes with defaults of their own, and why that is no second copy
ALLOWED = {
    ("SamplingParams", "RLConfig"): "one engine request; a run's come from rl.temperature and "
                                    "rl.max_new_tokens (tasks.base.agent_config)",
    ("Sampling", "RLConfig"): "the embedded server's parse of a request's sampling params",
    ("ClientConfig", "ReliabilityConfig"): "a judge's client: rl.judge's keys, untyped in the "
                                           "schema, so these defaults are the only ones",
    ("ClientConfig", "SummarizerConfig"): "as above; env.visit.summarizer sets its own",
}


def _defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _component_dataclasses() -> list[type]:
    found: dict[str, type] = {}
    for name in COMPONENTS:
        pkg = importlib.import_module(f"megatron_rl.{name}")
        for info in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}."):
            mod = importlib.import_module(info.name)
            for obj in vars(mod).values():
                if inspect.isclass(obj) and dataclasses.is_dataclass(obj) \
                        and obj.__module__ == mod.__name__:
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


def test_no_component_dataclass_copies_a_schema_default():
    sections = [c for c in vars(schema).values() if inspect.isclass(c)
                and dataclasses.is_dataclass(c) and c.__module__ == schema.__name__]
    drift = []
    for cls in _component_dataclasses():
        mine = _defaults(cls)
        for section in sections:
            theirs = _defaults(section)
            common = set(mine) & set(theirs)
            if len(common) < 2 or (cls.__name__, section.__name__) in ALLOWED:
                continue  # one shared name (`seed`, `model`) is not a copy of a section
            drift += [f"{cls.__qualname__}.{k}={mine[k]!r} vs {section.__name__}.{k}="
                      f"{theirs[k]!r}" for k in sorted(common) if mine[k] != theirs[k]]
    assert not drift, drift


def test_the_agent_takes_its_values_from_the_recipe():
    # no defaults for what a recipe sets: a run cannot fall back on a second copy
    required = {f.name for f in dataclasses.fields(AgentConfig)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert required == {"max_turns", "max_context_tokens", "sampling"}
    bare = AgentConfig(max_turns=1, max_context_tokens=64,
                       sampling=SamplingParams(max_new_tokens=8))
    assert bare.limits == schema.AgentLimitsConfig()  # the schema's defaults, nowhere else
    from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
    from megatron_rl.tasks.base import build_agents

    cfg = load_config(None, ["rl.max_turns=5", "rl.max_new_tokens=16", "rl.temperature=0.7",
                             "model.seq_length=512", "rl.agent_limits.max_tool_calls=7",
                             "rl.agent_limits.max_tool_calls_per_turn=2",
                             "rl.agent_limits.max_continuations=0",
                             "rl.agent_limits.max_observation_tokens=100",
                             "rl.agent_limits.tool_timeout_s=9"])
    agent, greedy = build_agents(cfg, tiny_qwen3_tokenizer(), [])
    for a, temperature in ((agent, 0.7), (greedy, 0.0)):
        c = a.config
        assert c.limits is cfg.rl.agent_limits
        assert (c.max_turns, c.max_context_tokens, c.seed) == (5, 512, cfg.train.seed)
        assert (c.sampling.max_new_tokens, c.sampling.temperature) == (16, temperature)
    assert dataclasses.asdict(cfg.rl.agent_limits) == {
        "max_tool_calls_per_turn": 2, "max_tool_calls": 7, "max_continuations": 0,
        "max_observation_tokens": 100, "tool_timeout_s": 9.0}
    with pytest.raises(ConfigError, match=r"rl.agent_limits.tool_timeout_s=0.0: must be > 0"):
        load_config(None, ["rl.agent_limits.tool_timeout_s=0"])
    with pytest.raises(ConfigError, match=r"'rl.max_tool_calls' \(did you mean "
                       r"'rl.agent_limits.max_tool_calls'\?\)"):
        load_config(None, ["rl.max_tool_calls=3"])


def test_loss_defaults_are_verls():
    loss = load_config(None).rl.loss
    assert (loss.clip_ratio_c, loss.clip_ratio_low, loss.clip_ratio_high) == (3.0, 0.2, 0.28)


@pytest.mark.parametrize("field,value,message", [
    ("judge", "genrmm", r"rl.judge.kind='genrmm': unknown judge \(did you mean 'genrm'\?\)"),
    ("rubric", "rulee", r"rl.rubric.kind='rulee': unknown rubric \(did you mean 'rule'\?\)"),
    ("judge", "''", r"rl.judge.kind='': expected a judge name"),
])
def test_judge_and_rubric_kinds_are_checked_at_load(field, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"rl.{field}={{kind: {value}}}"])


def test_known_kinds_import_paths_and_default_kinds_load():
    cfg = load_config(None, ["rl.judge={kind: genrm, base_url: 'http://j/v1'}",
                             "rl.rubric={kind: 'my_pkg.mod:MyScorer'}"])
    assert cfg.rl.judge == {"kind": "genrm", "base_url": "http://j/v1"}
    # no kind: the builder's default (rule judge; llm rubric), checked when it is built
    assert load_config(None, ["rl.rubric={pool: judge}"]).rl.rubric == {"pool": "judge"}


def test_registry_fields_are_checked_in_a_process_that_imported_no_registry():
    code = ("import sys\n"
            "from megatron_rl.config.loader import ConfigError, load_config\n"
            "assert 'megatron_rl.tasks' not in sys.modules\n"
            "for o in ('rl.agent=reactt', 'rl.judge={kind: genrmm}'):\n"
            "    try:\n"
            "        load_config(None, [o])\n"
            "    except ConfigError as e:\n"
            "        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()
    assert out[0].startswith("rl.agent='reactt': unknown agent (did you mean 'react'?)")
    assert out[1].startswith("rl.judge.kind='genrmm': unknown judge")
