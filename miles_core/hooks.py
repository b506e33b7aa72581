"""Hooks around the training step: the defaults of the `hooks.*` plug-points, which do nothing.

Signatures (checked by a contract test; a hook's return value is ignored unless stated):
* hooks.before_train_step  before_train_step(trainer, samples, iteration)
      called with the trainer and the scored samples before the step's first optimizer step.
* hooks.after_train_step   after_train_step(trainer, metrics, iteration)
      called after the step with its metrics dict (which it may extend in place).
* hooks.after_save         after_save(ckpt_dir, iteration)
      called once the step's checkpoint directory is complete.
* hooks.rollout_log        rollout_log(samples, metrics, iteration) -> dict[str, float]
      called after scoring; the metrics it returns are logged with the rollout's.
"""

from __future__ import annotations


def before_train_step(trainer, samples, iteration: int) -> None:
    pass


def after_train_step(trainer, metrics: dict, iteration: int) -> None:
    pass


def after_save(ckpt_dir: str, iteration: int) -> None:
    pass


def rollout_log(samples, metrics: dict, iteration: int) -> dict[str, float]:
    return {}
