"""Reward functions: the `RewardFn` plug-point and the built-in rewards."""

from miles_core.rewards.base import RewardFn
from miles_core.rewards.math import integer_answer

__all__ = ["RewardFn", "integer_answer"]
