"""EntroPIC PI controller on the entropy coefficient: hand-computed steps, clamping and
anti-windup, state round trip."""

from __future__ import annotations

import pytest

from megatron_rl.algorithms.entropy import EntropyPIController


def _ctrl() -> EntropyPIController:
    return EntropyPIController(target=1.0, kp=0.01, ki=0.005, init_coef=0.001,
                               coef_min=0.0, coef_max=0.02)


def test_pi_steps_clamp_and_anti_windup():
    c = _ctrl()
    # coef = 0.001 + 0.01 e + 0.005 I
    # H 0.5: e 0.5,  I 0.5 -> 0.001 + 0.005 + 0.0025 = 0.0085
    assert c.update(0.5) == pytest.approx(0.0085)
    # H 0.8: e 0.2,  I 0.7 -> 0.001 + 0.002 + 0.0035 = 0.0065
    assert c.update(0.8) == pytest.approx(0.0065)
    # H 1.4: e -0.4, I 0.3 -> 0.001 - 0.004 + 0.0015 = -0.0015 -> clamped to 0;
    #        the error pushes further below the floor: I stays 0.7
    assert c.update(1.4) == 0.0 and c.integral == pytest.approx(0.7)
    # H 1.0: e 0,    I 0.7 -> 0.001 + 0.0035 = 0.0045
    assert c.update(1.0) == pytest.approx(0.0045)
    # H 0:   e 1,    I 1.7 -> 0.001 + 0.01 + 0.0085 = 0.0195
    assert c.update(0.0) == pytest.approx(0.0195)
    # H 0:   e 1,    I 2.7 -> 0.0245 -> clamped to 0.02; winding up: I stays 1.7
    assert c.update(0.0) == 0.02 and c.integral == pytest.approx(1.7)
    # H 1.5: e -0.5, I 1.2 -> 0.001 - 0.005 + 0.006 = 0.002 (recovers at once)
    assert c.update(1.5) == pytest.approx(0.002)


def test_state_round_trip_and_validation():
    a = _ctrl()
    a.update(0.5)
    b = _ctrl()
    b.load_state_dict(a.state_dict())
    assert b.update(0.8) == pytest.approx(a.update(0.8))
    with pytest.raises(ValueError, match="empty"):
        EntropyPIController(target=1.0, kp=0.1, ki=0.1, coef_min=1.0, coef_max=0.0)
