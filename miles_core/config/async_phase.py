"""async_phase: the asynchronous rollout/train phase on Ray."""

from __future__ import annotations

from dataclasses import dataclass

from miles_core.config.base import check as _check
from miles_core.config.base import check_finite

SCHEDULES = ("sync", "async", "mixed")
STALE_POLICIES = ("drop", "regenerate")


@dataclass(frozen=True)
class AsyncConfig:
    """The asynchronous phase (miles_core/async_loop.py): rollout actors stream scored groups into a
    bounded buffer while a trainer actor drains it, K training steps per Flyte task.

    schedule: sync = every iteration is a rollout/score/train/publish chain of tasks; async = the
    iterations run as async phases of `steps_per_phase` steps; mixed = the first `sync_iterations`
    iterations sync, the rest async phases.
    """

    schedule: str = "sync"  # sync | async | mixed
    sync_iterations: int = 0  # mixed: how many sync iterations come first
    steps_per_phase: int = 4  # K: training steps per async phase (the last phase may be shorter)
    update_weights_interval: int = 1  # push the trainer's weights to the rollout actors every k steps
    max_staleness: int = 1  # a consumed sample's weight version >= trainer version - max_staleness
    stale_policy: str = "drop"  # drop | regenerate: what happens to a group older than the bound
    partial_rollout: bool = False  # a weight update interrupts in-flight generation, which continues under the new weights
    partial_segment_tokens: int = 2  # partial rollout: tokens generated between checks for new weights
    mask_stale_tokens: bool = False  # partial rollout: loss mask 0 on tokens an older policy produced
    rollout_workers: int = 2  # rollout actors, each owning one engine
    prompts_per_lease: int = 4  # prompts a rollout actor generates per call
    queue_size: int = 64  # groups ready or being generated, at most (the bounded queue)
    worker_cpus: float = 0.5  # Ray CPUs reserved per rollout actor
    trainer_cpus: float = 1.0  # Ray CPUs reserved for the trainer actor
    threads_per_actor: int = 1  # torch threads in each actor
    push_timeout_s: float = 120.0  # a weight push not acknowledged by every actor by then fails the phase
    take_timeout_s: float = 600.0  # the trainer waiting this long for a batch fails the phase
    max_restarts: int = 3  # Ray restarts of a dead rollout actor (its unfinished prompts are handed out again)

    def __post_init__(self):
        check_finite(self, "async_phase")
        _check(self.schedule in SCHEDULES, "async_phase.schedule", f"unknown schedule {self.schedule!r} (available: {', '.join(SCHEDULES)})")
        _check(self.sync_iterations >= 0, "async_phase.sync_iterations", "must be >= 0")
        _check(self.schedule == "mixed" or self.sync_iterations == 0, "async_phase.sync_iterations", "only the mixed schedule has sync iterations")
        for name in (
            "steps_per_phase",
            "update_weights_interval",
            "rollout_workers",
            "prompts_per_lease",
            "queue_size",
            "partial_segment_tokens",
            "threads_per_actor",
        ):
            _check(getattr(self, name) >= 1, f"async_phase.{name}", "must be >= 1")
        _check(self.stale_policy in STALE_POLICIES, "async_phase.stale_policy", f"unknown policy {self.stale_policy!r} (available: drop, regenerate)")
        _check(
            self.max_staleness >= self.update_weights_interval - 1,
            "async_phase.max_staleness",
            f"must be >= update_weights_interval - 1 = {self.update_weights_interval - 1}, or the trainer waits for samples no actor can produce",
        )
        _check(self.prompts_per_lease <= self.queue_size, "async_phase.prompts_per_lease", "must be <= async_phase.queue_size")
        _check(self.max_staleness >= 0, "async_phase.max_staleness", "must be >= 0")
        for name in ("worker_cpus", "trainer_cpus"):
            _check(getattr(self, name) >= 0, f"async_phase.{name}", f"must be >= 0 (Ray CPUs), got {getattr(self, name)}")
        for name in ("push_timeout_s", "take_timeout_s"):
            _check(getattr(self, name) > 0, f"async_phase.{name}", f"must be > 0 seconds, got {getattr(self, name)}")
        _check(self.max_restarts >= 0, "async_phase.max_restarts", "must be >= 0")
