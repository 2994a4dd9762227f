"""2-process layouts against 1 process on identical weights and data (gloo, fp32).

All runs start from one checkpoint written by the 1-process model and loaded (resharded) into
each layout, because fresh initialisation differs across layouts for EP and PP.
"""

from __future__ import annotations

import pytest
import torch

from tests import dist_cases
from tests.pools import get_pool

LAYOUTS = {
    "tp2-sp": ["parallel.tp=2"],
    "ep2-alltoall": ["parallel.ep=2"],
    "ep2-allgather": ["parallel.ep=2", "parallel.moe_dispatcher=allgather"],
    "pp2": ["parallel.pp=2"],
    "dp2": [],
    "dp2-distopt": ["parallel.distributed_optimizer=true"],
    "ep2-distopt": ["parallel.ep=2", "parallel.distributed_optimizer=true"],
    "tp2-sp-distopt": ["parallel.tp=2", "parallel.distributed_optimizer=true"],
}
TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    init = str(root / "init")
    pool = get_pool(1)
    pool.run(dist_cases.save_initial, init)
    ref = {}
    for distopt in (False, True):
        ov = [f"parallel.distributed_optimizer={str(distopt).lower()}"]
        ref[distopt] = pool.run(dist_cases.two_steps, ov, init, str(root / f"ref{int(distopt)}"))[0]
    return root, init, ref


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(name, reference):
    root, init, ref = reference
    overrides = LAYOUTS[name]
    distopt = "parallel.distributed_optimizer=true" in overrides
    expect = ref[distopt]
    saved = str(root / name)
    got = get_pool(2).run(dist_cases.two_steps, overrides, init, saved)
    print(f"\n{name}: ref {expect}\n{name}: got {got[0]}")
    for rank_result in got:  # every rank reports the same global numbers
        for key in ("loss", "grad_norm", "loss_after", "loss2", "grad_norm2"):
            assert abs(rank_result[key] - expect[key]) <= TOL, (name, key, rank_result, expect)

    # the optimizer step produced the same parameters: load both into one process and compare
    pool1 = get_pool(1)
    ov = ["parallel.distributed_optimizer=true"] if distopt else []
    mine = pool1.run(dist_cases.full_parameters, saved, ov)[0]
    theirs = pool1.run(dist_cases.full_parameters, str(root / f"ref{int(distopt)}"), ov)[0]
    assert mine.keys() == theirs.keys()
    worst = max((mine[k] - theirs[k]).abs().max().item() for k in mine)
    print(f"{name}: max |param diff| after one Adam step = {worst:.3g}")
    assert worst <= TOL


@pytest.mark.parametrize("name", ["tp2-sp", "ep2-alltoall", "pp2", "ep2-distopt"])
def test_resharded_resume_continues_identically(name, reference):
    """A 2-process checkpoint (model + optimizer) loaded at 1 process takes the same 2nd step."""
    root, init, ref = reference
    overrides = LAYOUTS[name]
    distopt = "parallel.distributed_optimizer=true" in overrides
    saved = root / name
    if not saved.exists():
        get_pool(2).run(dist_cases.two_steps, overrides, init, str(saved))
    ov = ["parallel.distributed_optimizer=true"] if distopt else []
    got = get_pool(1).run(dist_cases.resume_and_step, ov, str(saved))[0]
    expect = ref[distopt]
    print(f"\n{name}→ws1: {got} vs {expect}")
    assert abs(got["loss_loaded"] - expect["loss_after"]) <= TOL
    assert abs(got["loss2"] - expect["loss2"]) <= TOL
    assert abs(got["grad_norm2"] - expect["grad_norm2"]) <= TOL


def test_tp2_logprobs_match_one_process_and_chunking_is_exact(reference):
    _root, init, _ = reference
    full = get_pool(1).run(dist_cases.logprobs_at, [], init, 1 << 20)[0]
    chunked = get_pool(1).run(dist_cases.logprobs_at, [], init, 16)[0]
    tp2 = get_pool(2).run(dist_cases.logprobs_at, ["parallel.tp=2"], init, 16)
    assert full.shape == (4, 64, 2)
    assert torch.isfinite(full).all()
    assert (chunked - full).abs().max().item() <= 1e-6
    for rank in tp2:
        assert (rank - full).abs().max().item() <= TOL


@pytest.mark.parametrize("layout", ["tp2-sp", "ep2-alltoall", "pp2"])
def test_qwen35_hybrid_trains_identically_at_2_ranks(layout, tmp_path):
    """Gated DeltaNet layers (pure-PyTorch kernels), gated attention, shared expert: the same
    two Adam steps at 2 ranks as at 1."""
    model = ["model.name=tiny-qwen3.5"]
    init = str(tmp_path / "init")
    get_pool(1).run(dist_cases.save_initial, init, model)
    expect = get_pool(1).run(dist_cases.two_steps, model, init, None)[0]
    got = get_pool(2).run(dist_cases.two_steps, model + LAYOUTS[layout], init, None)
    print(f"\nqwen3.5 {layout}: ref {expect}\nqwen3.5 {layout}: got {got[0]}")
    assert expect["loss2"] < expect["loss"]  # it learns
    for rank_result in got:
        for key in ("loss", "grad_norm", "loss_after", "loss2", "grad_norm2"):
            assert abs(rank_result[key] - expect[key]) <= TOL, (layout, key, rank_result)
