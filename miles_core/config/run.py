"""The whole run: every section, the run's name, root and length; cross-section rules in rules.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_core.config.algo import AlgoConfig
from miles_core.config.async_phase import AsyncConfig
from miles_core.config.base import check as _check
from miles_core.config.base import check_finite
from miles_core.config.cluster import ClusterConfig
from miles_core.config.data import DataConfig, SFTConfig
from miles_core.config.debug import DebugConfig
from miles_core.config.distill import DistillConfig
from miles_core.config.model import ModelConfig
from miles_core.config.reward import RewardConfig
from miles_core.config.rollout import RolloutConfig
from miles_core.config.rules import check_rules
from miles_core.config.train import EvalConfig, HealthConfig, HooksConfig, PublishConfig, TrackingConfig, TrainConfig


@dataclass(frozen=True)
class RunConfig:
    name: str = "tiny_arith_cpu"
    run_root: str = "runs"
    iterations: int = 20
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    async_phase: AsyncConfig = field(default_factory=AsyncConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def __post_init__(self):
        _check(bool(self.name) and "/" not in self.name, "name", f"must be a non-empty name without '/', got {self.name!r}")
        _check(self.iterations >= 1, "iterations", "must be >= 1")
        check_finite(self, "")  # every section, also those whose own checks do not call it
        check_rules(self)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        """A RunConfig from JSON (what `pyflyte run ... --cfg` passes), checked key by key like a recipe: an unknown or
        misspelt key anywhere, or a value of the wrong type, is refused with its key path. flytekit's command line builds
        a dataclass input through its `from_json`."""
        from miles_core.config.recipe import config_from_json  # recipe.py reads recipes into this class: imported when called

        return config_from_json(text)
