"""reward: the reward function and its range."""

from __future__ import annotations

from dataclasses import dataclass

from miles_core.config.base import check as _check


@dataclass(frozen=True)
class RewardConfig:
    fn: str = "miles_core.rewards.math:integer_answer"  # plug-point: fn(response, label, metadata)
    min: float = 0.0
    max: float = 1.0
    group_fn: str = "miles_core.rewards.base:each_sample"  # plug-point: group_fn(reward_fn, responses)
    post_fn: str = "miles_core.rewards.base:no_post_processing"  # plug-point: post_fn(samples, group_size)
    fallback: float = 0.0  # the reward of a sample whose reward function failed (clamped into [min, max])
    default_type: str = "math"  # rewards.hub:by_metadata's type when metadata has no reward_type
    remote_url: str = ""  # rewards.hub:remote's reward model endpoint (POST)
    remote_timeout_s: float = 10.0
    remote_retries: int = 2

    def __post_init__(self):
        _check(self.min < self.max, "reward.max", "must be > reward.min")
        _check(self.remote_timeout_s > 0, "reward.remote_timeout_s", "must be > 0")
        _check(self.remote_retries >= 0, "reward.remote_retries", "must be >= 0")

