"""The rules that relate two config sections, in one table, checked whenever a RunConfig is built.

Each rule is (key path it reports, when it applies, what must hold, why). A section's own value
checks live in its dataclass; only rules that need two sections are here.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from miles_core.config.base import ConfigError


class Rule(NamedTuple):
    key: str
    applies: Callable  # (RunConfig) -> bool
    holds: Callable  # (RunConfig) -> bool
    reason: Callable  # (RunConfig) -> str, the message when it does not hold


def _async(c) -> bool:
    return c.async_phase.schedule != "sync"


RULES: tuple[Rule, ...] = (
    Rule("algo.advantage", lambda c: c.algo.advantage == "rloo", lambda c: c.rollout.n_samples >= 2,
         lambda c: "rloo needs rollout.n_samples >= 2"),
    Rule("async_phase.queue_size", _async, lambda c: c.async_phase.queue_size >= c.rollout.prompts_per_step,
         lambda c: f"must be >= rollout.prompts_per_step ({c.rollout.prompts_per_step}): the trainer takes that many groups per step"),
    Rule("async_phase.schedule", _async, lambda c: c.algo.advantage != "ppo",
         lambda c: "async phases do not train a critic yet: use a critic-free estimator or schedule: sync"),
    Rule("async_phase.rollout_workers", lambda c: _async(c) and c.rollout.engine == "sglang" and bool(c.rollout.sglang.urls.strip()),
         lambda c: c.async_phase.rollout_workers == 1,
         lambda c: "attached SGLang servers (rollout.sglang.urls) take weights from one rollout actor: set 1, or let each actor launch its own servers"),
    Rule("async_phase.sync_iterations", _async, lambda c: c.async_phase.sync_iterations < c.iterations,
         lambda c: f"must be < iterations ({c.iterations}) so that an async phase runs"),
)


def check_rules(cfg) -> None:
    """Raise ConfigError naming the key of the first rule `cfg` breaks."""
    for rule in RULES:
        if rule.applies(cfg) and not rule.holds(cfg):
            raise ConfigError(f"{rule.key}: {rule.reason(cfg)}")
