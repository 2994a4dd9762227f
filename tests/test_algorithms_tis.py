"""Rollout importance weights (TIS) and mismatch metrics on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms.tis import TISConfig, rollout_is_weights

LN = math.log
# rollout log-probs 0; train - rollout per token:
#   row 0: [0, ln 3, ln 0.5] -> token ratios [1, 3, 0.5]
#   row 1: [ln 1.5, 9 (masked out)] padded to 3 -> ratio [1.5]
TRAIN = torch.tensor([[0.0, LN(3.0), LN(0.5)], [LN(1.5), 9.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])
# |diff| = [0, 1.098612, 0.693147, 0.405465], sum 2.197225, mean over 4 tokens 0.549306
ABS_DIFF = (LN(3.0) + LN(2.0) + LN(1.5)) / 4


def _tis(**kw) -> tuple[list[float], dict[str, float]]:
    res = rollout_is_weights(TRAIN, torch.zeros_like(TRAIN), MASK, TISConfig(**kw))
    return res.weights.flatten().tolist(), res.metrics


def test_token_truncate():
    # ratios [1, 3, 0.5, 1.5] (mean 6/4 = 1.5) -> w = [1, 2, 0.5, 1.5]
    # ESS = (1 + 2 + 0.5 + 1.5)^2 / (4 * (1 + 4 + 0.25 + 2.25)) = 25 / 30 = 0.833333
    w, m = _tis()
    assert w == pytest.approx([1, 2, 0.5, 1.5, 0, 0])
    assert m == pytest.approx({"mismatch/rollout_is_mean": 1.5,
                               "mismatch/rollout_is_eff_sample_size": 25 / 30,
                               "mismatch/rollout_is_veto_fraction": 0.0,
                               "mismatch/rollout_is_clipped_fraction": 0.25,
                               "mismatch/train_rollout_logprob_abs_diff": ABS_DIFF})
    assert ABS_DIFF == pytest.approx(0.549306, abs=1e-6)


def test_token_mask():
    # the ratio-3 token is dropped: w = [1, 0, 0.5, 1.5]; ESS = 3^2 / (4 * 3.5) = 0.642857
    w, m = _tis(mode="mask")
    assert w == pytest.approx([1, 0, 0.5, 1.5, 0, 0])
    assert m["mismatch/rollout_is_eff_sample_size"] == pytest.approx(9 / 14)


def test_sequence_level():
    # row ratios: 1 * 3 * 0.5 = 1.5 and 1.5; mean 1.5
    w, m = _tis(level="sequence")                    # under 2: kept as they are
    assert w == pytest.approx([1.5, 1.5, 1.5, 1.5, 0, 0])
    assert m["mismatch/rollout_is_mean"] == pytest.approx(1.5)
    assert m["mismatch/rollout_is_eff_sample_size"] == pytest.approx(1.0)
    w, m = _tis(level="sequence", threshold=1.2)     # both truncated to 1.2
    assert w == pytest.approx([1.2, 1.2, 1.2, 1.2, 0, 0])
    assert m["mismatch/rollout_is_clipped_fraction"] == 1.0
    w, m = _tis(level="sequence", mode="mask", threshold=1.2)  # both dropped
    assert w == [0.0] * 6 and m["mismatch/rollout_is_eff_sample_size"] == 0.0


def test_veto():
    # row 0 has a token ratio 0.5 < 0.6: the whole row gets 0; veto fraction 1 / 2 rows
    # token truncate: w = [0, 0, 0, 1.5]; ESS = 1.5^2 / (4 * 1.5^2) = 0.25
    w, m = _tis(veto_threshold=0.6)
    assert w == pytest.approx([0, 0, 0, 1.5, 0, 0])
    assert m["mismatch/rollout_is_veto_fraction"] == 0.5
    assert m["mismatch/rollout_is_eff_sample_size"] == pytest.approx(0.25)
    w, _ = _tis(level="sequence", veto_threshold=0.6)
    assert w == pytest.approx([0, 0, 0, 1.5, 0, 0])


def test_bad_config():
    with pytest.raises(ValueError, match="mode"):
        TISConfig(mode="clip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threshold"):
        rollout_is_weights(TRAIN, torch.zeros_like(TRAIN), MASK, TISConfig(threshold=0.0))
