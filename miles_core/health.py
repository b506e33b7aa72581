"""Health gates: each training step's numbers against the recipe's thresholds (the `health` section).

`check` runs in `step.train_step`, after the step's update and before anything is saved, in the sync train task
and in the async phase's trainer alike. A gate out of bounds raises `HealthGateTripped`, which names the gate, its
value and its threshold: the step's checkpoint is never written, so the last published policy stays the run's,
and the error is not retried (the same batch would trip it again). NaN or infinity in the loss or the gradient
norm always trips; every other gate is off at 0.
"""

from __future__ import annotations

import math
import statistics

from miles_core.config import HealthConfig
from miles_core.samples import Sample


class HealthGateTripped(RuntimeError):
    def __init__(self, gate: str, value: float, bound: str):
        self.gate, self.value = gate, value
        super().__init__(f"health gate {gate} tripped at {value:.6g} ({bound}): the step's weights are not saved, the last published policy stands")


def gate_values(metrics: dict[str, float], samples: list[Sample]) -> dict[str, float]:
    """{health/<gate>: the value the gate reads} of a step's metrics and batch; staleness where the batch has it (the
    async trainer stamps each sample with the version it trains, `trainer_version`)."""
    values = {
        "health/loss": metrics.get("train/loss", 0.0),
        "health/grad_norm": metrics.get("train/grad_norm_max", 0.0),
        "health/mismatch_kl": metrics.get("mismatch/kl_rollout_train", 0.0),
        "health/reward_std": statistics.pstdev(s.reward for s in samples) if samples else 0.0,
    }
    lags = [s.metadata["trainer_version"] - s.weight_version for s in samples if "trainer_version" in s.metadata]
    if lags:
        values["health/staleness"] = float(max(lags))
    if "routing/agreement" in metrics:  # routing replayed (R3)
        values["health/routing_agreement"] = metrics["routing/agreement"]
    return values


def check(cfg: HealthConfig, metrics: dict[str, float], samples: list[Sample]) -> dict[str, float]:
    """The gates' values of one step (`gate_values`); raises HealthGateTripped at the first gate out of bounds."""
    values = gate_values(metrics, samples)
    for name in ("health/loss", "health/grad_norm"):
        if not math.isfinite(values[name]):
            raise HealthGateTripped(name.split("/")[1], values[name], "must be finite")
    upper = {"grad_norm": cfg.max_grad_norm, "mismatch_kl": cfg.max_mismatch_kl, "staleness": cfg.max_staleness}
    for gate, limit in upper.items():
        value = values.get(f"health/{gate}")
        if limit and value is not None and value > limit:
            raise HealthGateTripped(gate, value, f"health.max_{gate} is {limit:g}")
    lower = {"reward_std": cfg.min_reward_std, "routing_agreement": cfg.min_routing_agreement}
    for gate, limit in lower.items():
        value = values.get(f"health/{gate}")
        if limit and value is not None and value < limit:
            raise HealthGateTripped(gate, value, f"health.min_{gate} is {limit:g}")
    return values
