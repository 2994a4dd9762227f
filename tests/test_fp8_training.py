"""FP8 training (`model.fp8`): mapped onto megatron's TransformerConfig fields, refused with a
message that says why where TE or an FP8-capable GPU is missing (CPU here), and one FP8 step on
a GPU (`gpu`-marked: tests/gpu/run_all.sh)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.config.fields import ConfigError
from megatron_rl.config.loader import load_config
from megatron_rl.models.builder import FP8_RECIPES, fp8_problem, fp8_settings
from tests import dist_cases
from tests.pools import get_pool


def test_fp8_config_field_and_the_cpu_refusal():
    assert load_config(None, []).model.fp8 is None
    assert fp8_settings(load_config(None, []).model) == {}
    with pytest.raises(ConfigError, match=r"model.fp8='fp4': must be one of \[None, 'delayed'"):
        load_config(None, ["model.fp8=fp4"])
    cfg = load_config(None, ["model.fp8=blockwise"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="model.fp8=blockwise: needs a CUDA GPU"):
            fp8_settings(cfg.model)


def test_fp8_refusals_name_the_missing_piece():
    ok = {"cuda": True, "te": True}
    assert fp8_problem("delayed", capability=(9, 0), **ok) is None
    assert fp8_problem("mxfp8", capability=(10, 0), **ok) is None
    assert "compute capability 8.0; the delayed recipe needs >= 8.9" in fp8_problem(
        "delayed", capability=(8, 0), **ok)
    assert "compute capability 9.0; the mxfp8 recipe needs >= 10.0 (Blackwell)" in fp8_problem(
        "mxfp8", capability=(9, 0), **ok)
    assert "needs Transformer Engine" in fp8_problem("delayed", cuda=True, te=False,
                                                     capability=(9, 0))
    assert "model.layer_impl=auto or transformer_engine" in fp8_problem(
        "delayed", capability=(9, 0), layer_impl="local", **ok)
    assert {k: v[:2] for k, v in FP8_RECIPES.items()} == {
        "delayed": ("hybrid", "delayed"), "blockwise": ("e4m3", "blockwise"),
        "mxfp8": ("e4m3", "mxfp8")}


def _fp8_steps(recipe: str) -> dict:
    actor = dist_cases.make_actor(["model.dtype=bf16", "optim.lr=1e-2", f"model.fp8={recipe}",
                                   "model.layer_impl=transformer_engine"])
    batch = dist_cases.fixed_batch()
    losses = [actor.train_step(batch, dist_cases.lm_loss)["loss"] for _ in range(4)]
    return {"losses": losses, "fp8": actor.config.fp8, "recipe": str(actor.config.fp8_recipe)}


@pytest.mark.gpu
def test_fp8_step_on_gpu_learns():
    cap = torch.cuda.get_device_capability()
    recipe = "blockwise" if cap >= (9, 0) else "delayed"
    if fp8_problem(recipe, cuda=True, capability=cap, te=True) is not None:
        pytest.skip(f"this GPU ({torch.cuda.get_device_name()}) cannot run FP8 {recipe}")
    r = get_pool(1).run(_fp8_steps, recipe)[0]
    print(f"fp8 {recipe}: {r}")
    assert r["fp8"] in ("e4m3", "hybrid") and recipe in r["recipe"]
    assert all(math.isfinite(x) for x in r["losses"]), r["losses"]
    assert r["losses"][-1] < r["losses"][0], r["losses"]
