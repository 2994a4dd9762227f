"""Checks that need CUDA (run by tools/gpu_check.sh on a lent GPU; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from tests import dist_cases
from tests.pools import get_pool

pytestmark = pytest.mark.gpu


def _te_train(overrides):
    from megatron_rl.models.builder import use_transformer_engine

    actor = dist_cases.make_actor(overrides)
    batch = dist_cases.fixed_batch()
    losses = [actor.train_step(batch, dist_cases.lm_loss)["loss"] for _ in range(4)]
    return losses, use_transformer_engine(actor.cfg.model)


def test_bf16_step_on_gpu_learns():
    losses, te = get_pool(1).run(_te_train, ["model.dtype=bf16", "optim.lr=1e-2"])[0]
    assert losses[-1] < losses[0], losses
    print("transformer engine spec:", te, "losses:", losses)


def test_cuda_is_visible():
    assert torch.cuda.is_available()
