"""EntroPIC-style entropy control: a PI controller that moves the entropy-bonus coefficient
(`rl.loss.entropy_coef`, subtracted from the loss) so the policy's entropy tracks a
target instead of collapsing or exploding over long runs.

    e_k    = target - H_k                     (> 0: entropy too low -> more bonus)
    I_k    = I_{k-1} + e_k
    coef_k = clamp(init_coef + kp * e_k + ki * I_k, coef_min, coef_max)

Anti-windup: while the output is clamped, an error that pushes further into the clamp is not
added to the integral (conditional integration), so the controller recovers as soon as the
entropy turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_rl.config.schema import EntropyControlConfig


@dataclass
class EntropyPIController:
    target: float
    kp: float
    ki: float
    coef_min: float
    coef_max: float
    init_coef: float = 0.0
    integral: float = 0.0
    coef: float | None = None  # the last output; None before the first update

    def __post_init__(self) -> None:
        if self.coef_min > self.coef_max:
            raise ValueError(f"entropy coef range [{self.coef_min}, {self.coef_max}] is empty")

    @classmethod
    def from_config(cls, cfg: EntropyControlConfig, init_coef: float) -> EntropyPIController:
        return cls(cfg.target, cfg.kp, cfg.ki, cfg.coef_min, cfg.coef_max, init_coef)

    def update(self, entropy: float) -> float:
        """The coefficient for the next step, given the mean token entropy of this one."""
        error = self.target - entropy
        integral = self.integral + error
        raw = self.init_coef + self.kp * error + self.ki * integral
        coef = min(max(raw, self.coef_min), self.coef_max)
        winding = (raw > self.coef_max and error > 0) or (raw < self.coef_min and error < 0)
        if not winding:
            self.integral = integral
        self.coef = coef
        return coef

    def state_dict(self) -> dict[str, Any]:
        return {"integral": self.integral, "coef": self.coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.integral, self.coef = float(state["integral"]), state["coef"]
