"""The memory planner (models/memory_plan.py, `megatron-rl plan`; docs/planner.md): every
shipped recipe fits, the per-rank parameter counts are the built models' own, and the planned
peak of a CPU train step is within 10 % of the measured one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config.fields import ConfigError
from megatron_rl.config.loader import CONFIG_ROOT, load_config
from megatron_rl.models import memory_plan as mp
from megatron_rl.models.registry import get_model_spec
from tests import plan_cases
from tests.pools import get_pool

RECIPES = sorted(p.stem for p in (CONFIG_ROOT / "recipes").glob("*.yaml"))
FIXTURES = Path(__file__).parent / "fixtures" / "plan"


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_recipe_fits(recipe):
    import megatron_rl.tasks  # noqa: F401  (the registries a recipe's names are checked in)

    cfg = load_config(recipe)
    result = mp.plan_config(cfg)
    assert result.fits, mp.format_plan(result)
    if result.device.shared:  # CPU recipes: this machine's memory, all ranks together
        assert result.device.name == "cpu"
    else:
        assert result.device.name == "h20" and result.trainer_peak <= result.usable


# (world, overrides): tiny MoE, tiny Qwen3.5 (GDN + gated attention + MTP), tied dense
LAYOUTS = [
    (1, ["model.name=tiny-moe"]),
    (1, ["model.name=tiny-qwen3.5"]),
    (2, ["model.name=tiny-qwen3.5", "parallel.tp=2"]),
    (2, ["model.name=tiny-qwen3.5", "parallel.pp=2"]),
    (2, ["model.name=tiny-qwen3.5", "parallel.ep=2"]),
    (2, ["model.name=tiny-moe", "parallel.tp=2", "parallel.etp=2"]),
    (2, ["model.name=tiny-moe", "parallel.tp=2", "parallel.ep=2"]),
    (2, ["model.name=tiny-dense", "parallel.pp=2"]),
    (4, ["model.name=tiny-qwen3.5", "parallel.tp=2", "parallel.pp=2", "parallel.ep=2"]),
]


@pytest.mark.parametrize("world,overrides", LAYOUTS, ids=[" ".join(o) for _, o in LAYOUTS])
def test_rank_parameters_are_the_built_models(world, overrides):
    cfg = load_config(None, overrides)
    spec = get_model_spec(cfg.model.name)
    lay = mp.Layout(tp=cfg.parallel.tp, pp=cfg.parallel.pp, ep=cfg.parallel.ep,
                    etp=cfg.parallel.etp, world=world)
    assert not mp.layout_problems(spec, lay)
    for built in get_pool(world).run(plan_cases.rank_parameters, overrides):
        stage = built.pop("__stage__")
        expert = sum(n for k, n in built.items() if ".experts.local_experts." in k)
        dense = sum(built.values()) - expert
        assert mp.rank_parameters(spec, lay, stage) == (dense, expert), (stage, built)


STEP = ["model.dtype=fp32", "optim.clip_grad=0", "model.seq_length=256",
        "train.micro_batch_size=4"]
# (world, overrides, rows of the global batch): every rank gets micro_batch_size rows
PEAKS = [
    (1, [f"model.name={FIXTURES / 'mid-qwen3.5.yaml'}", "train.global_batch_size=4"], 4),
    (2, [f"model.name={FIXTURES / 'mid-moe.yaml'}", "parallel.ep=2",
         "parallel.distributed_optimizer=true", "train.global_batch_size=8",
         "rollout.trainer_ranks=2"], 8),
]


@pytest.mark.parametrize("world,overrides,rows", PEAKS, ids=["qwen3.5-hybrid", "moe-ep2-distopt"])
def test_planned_peak_is_the_measured_cpu_peak(world, overrides, rows):
    """Measured: the peak RSS of a steady-state step (the second, Adam's states in place) over
    the rank's RSS before its actor was built, large blocks mmap'd so freed tensors leave the
    RSS (tests/plan_cases.py); the build alone in malloc's live bytes (its RSS growth moved
    with the heap chunks the worker's earlier jobs had freed). Planned: weights + fp32 grads
    + Adam states + activations + transients of that rank."""
    cfg = load_config(None, STEP + overrides)
    result = mp.plan_config(cfg, "cpu")
    stage = result.stages[0]
    for measured in get_pool(world).run(plan_cases.peak_step_memory, STEP + overrides, rows,
                                        cfg.model.seq_length):
        assert measured["params"] == stage.params
        static = stage.weights + stage.grads  # what building the actor allocates
        assert measured["built"] == pytest.approx(static, rel=0.10)
        assert measured["peak"] == pytest.approx(stage.train_peak, rel=0.10), (
            measured, mp.format_plan(result))


def test_an_oversized_layout_gets_a_proposal(capsys):
    # the 235B model's trainer on one node cannot fit: exit 1 and a layout on more GPUs
    code = main(["plan", "--model", "qwen3-235b-a22b", "--nodes", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and not out["fits"]
    proposal = out["proposal"]
    assert proposal["fits"] and proposal["gpus"] > 8
    assert proposal["peak_gib"] <= proposal["usable_gib"]


def test_recipe_plan_prints_the_budget(capsys):
    assert main(["plan", "--recipe", "qwen3-30b-a3b-h20"]) == 0
    text = capsys.readouterr().out
    for word in ("weights", "grads", "optim", "offload", "activ", "engine", "fits"):
        assert word in text


def test_a_recipe_that_does_not_fit_is_told_what_would(capsys):
    # an engine share the GPU cannot hold even with the trainer parked on the host: the plan
    # names a fraction that fits
    code = main(["plan", "--recipe", "qwen3-8b-h20", "rollout.engine_mem_fraction=0.9"])
    text = capsys.readouterr().out
    assert code == 1 and "does NOT fit" in text and "rollout.engine_mem_fraction=" in text


def test_colocated_engines_have_the_gpu_while_the_trainer_is_parked_on_the_host():
    cfg = load_config("qwen3-8b-h20")
    colocated = mp.plan_config(cfg)
    s = colocated.stages[0]
    # the trainer offloads before every rollout (engines/colocation.py): nothing of it stays
    assert s.resident == 0 and s.peak == max(s.train_peak, s.engine + s.overhead)
    assert any("pinned host memory" in n for n in colocated.notes)
    apart = mp.plan_config(load_config("qwen3-8b-h20", ["rollout.layout=disaggregated"]))
    d = apart.stages[0]
    assert d.engine == 0 and d.resident == d.weights + d.grads + d.optimizer


def test_bad_plan_inputs_name_the_field():
    with pytest.raises(ConfigError, match="optim.cpu_offload_fraction"):
        load_config(None, ["optim.cpu_offload_fraction=1.5"])
    with pytest.raises(ConfigError, match="optim.cpu_offload_fraction"):
        load_config(None, ["optim.cpu_offload_fraction=0.5"])  # no distributed optimizer
    with pytest.raises(ConfigError, match="rollout.engine_mem_fraction"):
        load_config(None, ["rollout.engine_mem_fraction=1.0"])
    with pytest.raises(ConfigError, match="model.recompute_granularity"):
        load_config(None, ["model.recompute_granularity=some"])
    with pytest.raises(ConfigError, match="--gpu"):
        mp.get_device("h30")
    assert main(["plan", "--recipe", "qwen3-4b-h20", "parallel.tp=3"]) == 1


def test_layout_problems_say_why():
    spec = get_model_spec("qwen3.5-397b-a17b")
    problems = mp.layout_problems(spec, mp.Layout(tp=8, pp=8, ep=32, world=256))
    assert any("pp=8 does not divide num_layers=60" in p for p in problems)
    assert any("tp=8" in p for p in problems)  # 2 KV groups
    engine = mp.Engine(kind="sglang", layout="disaggregated", num_engines=1, gpus=16)
    result = mp.plan(spec, mp.Layout(tp=2, pp=6, ep=8, world=48, sp=True, offload=1.0,
                                     recompute="full"),
                     mp.Workload(tokens=32768), engine, mp.get_device("h20"))
    assert not result.fits and any("spans at most one node" in p for p in result.problems)


def test_the_new_fields_reach_megatron_and_sglang():
    from megatron_rl.engines.ray_engine import engine_spec
    from megatron_rl.models.builder import transformer_config

    cfg = load_config("qwen3.5-35b-a3b-h20")
    assert engine_spec(cfg.rollout).sglang == {"mem_fraction_static": 0.8, "ep_size": 4}
    assert engine_spec(cfg.rollout, gpus=4).sglang == {}  # an aux pool keeps its own
    # an embedded engine decodes on its CPU share's threads
    embedded = load_config(None, ["rollout.engine_cpus=2.5"]).rollout
    spec = engine_spec(embedded, random_init="tiny-moe")
    assert spec.threads == 2
    cmd = spec.engine_kind().command(spec, "127.0.0.1", 1)[0]
    assert cmd[cmd.index("--threads") + 1] == "2"
    cfg = load_config(None, ["model.recompute_activations=true",
                             "model.recompute_granularity=selective"])
    tc = transformer_config(get_model_spec("tiny-moe"), cfg.model, cfg.parallel)
    assert tc.recompute_granularity == "selective" and tc.recompute_modules == ["core_attn"]
