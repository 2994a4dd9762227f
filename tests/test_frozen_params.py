"""`optim.frozen`: parameters matched by name do not train (no grad buffer, no optimizer
state), across a save and a resume of model and optimizer; a pattern that matches nothing,
or freezes everything, is an error naming it."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.trainer.actor import freeze
from tests import dist_cases
from tests.pools import get_pool


def test_frozen_parameters_stay_and_the_rest_trains_across_a_resume(tmp_path):
    moved = get_pool(1).run(dist_cases.frozen_step, ["optim.frozen=[word_embeddings]"],
                            str(tmp_path / "ckpt"))[0]
    frozen = [n for n in moved if "word_embeddings" in n]
    assert frozen and all(moved[n] == 0.0 for n in frozen), moved
    rest = [n for n in moved if n not in frozen]
    assert rest and sum(moved[n] > 0 for n in rest) >= 0.9 * len(rest), moved


def test_a_pattern_that_matches_nothing_or_everything_is_refused():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    with pytest.raises(ValueError, match=r"'embeding' matches no parameter"):
        freeze(module, ["embeding"])
    with pytest.raises(ValueError, match="freezes every parameter"):
        freeze(module, ["weight", "bias"])
    with pytest.raises(ValueError, match="not a regular expression"):
        freeze(module, ["("])
    assert freeze(module, [r"^0\."]) == ["0.weight", "0.bias"]
    assert [p.requires_grad for p in module.parameters()] == [False, False, True, True]
