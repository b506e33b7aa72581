"""Sampling control: which groups a step keeps, which buffered groups it takes, which samples it trains on.

Each function is the default of a plug-point (signatures below, checked by a contract test):
* rollout.dynamic_filter_fn  filter(group: list[Sample]) -> str | None
      None keeps the group; a string drops it and names the reason (counted as a metric).
* rollout.buffer_filter_fn   take(buffer: list[list[Sample]], n: int) -> (taken, remaining)
      chooses up to n groups from the buffer of leftover groups.
* algo.sample_filter_fn      keep(sample: Sample) -> bool
      False takes the sample out of the loss (its loss mask is zeroed); it still counts in its
      group's advantage statistics.
"""

from __future__ import annotations

from miles_core.samples import Sample


def nonzero_reward_std(group: list[Sample]) -> str | None:
    """DAPO dynamic sampling: a group whose rewards are all equal has zero advantage; drop it."""
    rewards = [s.reward for s in group]
    return f"zero_std_reward_{rewards[0]:g}" if max(rewards) == min(rewards) else None


def oldest_first(buffer: list[list[Sample]], n: int) -> tuple[list[list[Sample]], list[list[Sample]]]:
    """Take the n groups that waited longest (lowest weight version first, then arrival order)."""
    order = sorted(range(len(buffer)), key=lambda i: (buffer[i][0].weight_version, i))
    chosen = set(order[:n])
    return [buffer[i] for i in order[:n]], [g for i, g in enumerate(buffer) if i not in chosen]


def keep_all(sample: Sample) -> bool:
    """Train on every sample."""
    return True
