"""A replay: a finished or failed run again from iteration N with changed settings (docs/replay.md).

Iterations before N are the parent run's own, under its config, so each of their nodes is a cache hit of the parent's
(a failed parent's missing ones run as the parent would have run them). From N the changed config trains either on
rollouts it generates itself (`regenerate`: on-policy; iteration N's rollout is still the parent's, a cache hit, when
the rollout settings did not change, since its policy is the parent's) or on the parent's own scored batches of
iterations N.. (`cached`: off-policy, the batches' rollout log-probs weighed against the trained policy by the
recipe's algo.is_correction).
"""

from __future__ import annotations

from miles_core.config import ConfigError, RunConfig, flatten
from miles_core.config.recipe import parse_overrides, with_overrides

ROLLOUT_MODES = ("regenerate", "cached")
# what the iterations before N and the checkpoint at N are made of, so what no replay changes
FIXED = ("run_root", "model.", "data.", "sft.", "train.backend", "train.lora.", "async_phase.", "distill.", "debug.")
# what the parent's batches were generated and scored with, so what a replay on them cannot change
CACHED_FIXED = ("iterations", "rollout.", "reward.")


def replayed(parent: RunConfig, changes: list[str], from_iteration: int, rollouts: str) -> RunConfig:
    """The config a replay of `parent` runs from iteration `from_iteration` on: `parent` with `changes` (`key=value`),
    checked; a ConfigError names what a replay cannot do."""
    if rollouts not in ROLLOUT_MODES:
        raise ConfigError(f"rollouts: must be one of {', '.join(ROLLOUT_MODES)}, got {rollouts!r}")
    if parent.async_phase.schedule != "sync":
        raise ConfigError("async_phase.schedule: a replay reruns sync iterations; the parent ran async phases")
    if not 0 <= from_iteration < parent.iterations:
        raise ConfigError(f"from_iteration: must be in [0, {parent.iterations}) (the parent's iterations), got {from_iteration}")
    cfg = with_overrides(parent, parse_overrides(changes))
    old, new = flatten(parent), flatten(cfg)
    fixed = FIXED + (CACHED_FIXED if rollouts == "cached" else ())
    for key in sorted(k for k in new if new[k] != old[k]):
        if key.startswith(fixed):
            raise ConfigError(f"{key}: a replay with rollouts {rollouts} cannot change it ({old[key]!r} -> {new[key]!r}): {_why(key)}")
    if cfg == parent:
        raise ConfigError("changes: nothing changed; the parent run's own result is already cached")
    if cfg.iterations <= from_iteration:
        raise ConfigError(f"iterations: {cfg.iterations} leaves nothing to run from iteration {from_iteration}")
    return cfg


def _why(key: str) -> str:
    if key.startswith(CACHED_FIXED):
        return "the parent's batches were generated and scored with it; use rollouts: regenerate"
    return "the iterations before from_iteration and the checkpoint they leave are made with it; start a new run instead"
