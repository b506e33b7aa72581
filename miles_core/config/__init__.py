"""Typed run configuration: frozen dataclasses with defaults, one module per section; recipes
(YAML) only override.

Every section checks its own values on construction (so a config that reaches a task through
Flyte is checked too); the rules relating two sections are one table (`rules.py`), checked when
a RunConfig is built; `load_recipe` also rejects unknown keys and wrong types, naming the key
path, before anything runs.
"""

from miles_core.config.algo import ADVANTAGES, AGGREGATIONS, KL_TYPES, LOG_RATIO_CLAMP, MISMATCH_THRESHOLD, POLICY_LOSSES, AlgoConfig
from miles_core.config.async_phase import SCHEDULES, STALE_POLICIES, AsyncConfig
from miles_core.config.base import ConfigError
from miles_core.config.cluster import ACCELERATORS, ClusterConfig
from miles_core.config.data import DataConfig, SFTConfig
from miles_core.config.debug import DebugConfig
from miles_core.config.distill import DistillConfig
from miles_core.config.model import MODEL_ARCHS, ModelConfig
from miles_core.config.recipe import config_hash, flatten, load_recipe
from miles_core.config.reward import RewardConfig
from miles_core.config.rollout import ENGINES, PAUSE_MODES, WEIGHT_SYNC_MODES, MultiTurnConfig, RolloutConfig, SGLangConfig
from miles_core.config.run import RunConfig
from miles_core.config.train import EvalConfig, HealthConfig, HooksConfig, LoraConfig, PublishConfig, TrackingConfig, TrainConfig

__all__ = [
    "ACCELERATORS",
    "ADVANTAGES",
    "AGGREGATIONS",
    "ENGINES",
    "KL_TYPES",
    "LOG_RATIO_CLAMP",
    "MISMATCH_THRESHOLD",
    "MODEL_ARCHS",
    "PAUSE_MODES",
    "POLICY_LOSSES",
    "SCHEDULES",
    "STALE_POLICIES",
    "WEIGHT_SYNC_MODES",
    "AlgoConfig",
    "AsyncConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "DistillConfig",
    "DebugConfig",
    "EvalConfig",
    "HealthConfig",
    "HooksConfig",
    "LoraConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "PublishConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SGLangConfig",
    "TrackingConfig",
    "TrainConfig",
    "config_hash",
    "flatten",
    "load_recipe",
]
