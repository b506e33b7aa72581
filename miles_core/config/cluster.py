"""cluster: what a Flyte cluster run needs beyond the experiment: retries, timeouts, spot nodes, GPU type,
torch elastic restarts and rendezvous, the loop's block size, which checkpoints and policies a run keeps, failure
notifications.

None of it is an input of a cached task (changing it re-runs nothing cached): the workflow applies it to the nodes
it builds (`with_overrides`, workflows/rl.py; the prune nodes, which are never cached, take what to keep), and the
launch plans (workflows/launch_plans.py) read the notification addresses. Local execution ignores retries, timeouts,
interruptible and accelerators.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from miles_core.config.base import check as _check

# GPU types a node may ask for: the device names of flytekit's accelerators (flytekit.extras.accelerators), which a
# cluster maps to its node labels
GPU_PLATFORMS = ("cuda", "rocm")
ACCELERATORS = ("nvidia-h100", "nvidia-h200", "nvidia-tesla-a100", "nvidia-a100-80gb", "nvidia-l40s", "nvidia-l4", "nvidia-a10g")
# the stages whose tasks the loop builds, each with a timeout of its own (cluster.<stage>_timeout_min)
TIMED_STAGES = ("convert", "rollout", "score", "teacher", "train", "publish", "evaluate", "async")
MAX_TIMEOUT_MIN = 7 * 24 * 60  # a week: longer is a typo, and no pod should hold GPUs that long unseen
_EMAIL = re.compile(r"^[^@\s,]+@[^@\s,]+\.[^@\s,]+$")


@dataclass(frozen=True)
class ClusterConfig:
    # Flyte retries a task on a *recoverable* failure only: the platform's system failures (a lost node, an evicted or
    # preempted pod) under its own budget, and user errors that are raised as FlyteRecoverableException (tasks/retry.py
    # turns network and object-store errors into one) under this budget. Any other error in a task's code fails it at once:
    # a bad batch or a bug fails the same way on every attempt.
    retries: int = 2
    interruptible: bool = True  # rollout, score and evaluate may run on interruptible (spot) nodes: cached and restartable
    accelerator: str = ""  # GPU type of every pod that asks for GPUs (ACCELERATORS); "" = whichever the cluster gives
    gpu_platform: str = "cuda"  # the image of the pods that train on GPUs (containers/images.py): cuda | rocm
    convert_timeout_min: int = 240
    rollout_timeout_min: int = 180
    score_timeout_min: int = 60
    teacher_timeout_min: int = 60  # on-policy distillation: the teacher's log-probs of one batch (tasks/distill.py teach)
    train_timeout_min: int = 240
    publish_timeout_min: int = 60
    evaluate_timeout_min: int = 120
    async_timeout_min: int = 720  # a whole async phase of async_phase.steps_per_phase steps
    # torch elastic restarts of the worker group (train, convert, publish) before the task fails; any worker's failure
    # restarts it, a bug's too, so a small number: it is for the worker lost with its node mid-step
    max_restarts: int = 0
    rdzv_timeout_s: int = 900  # torch elastic rendezvous: how long the nodes of a multi-node task wait for each other
    rdzv_join_timeout_s: int = 900  # ... and for a late node to join (pods start at different times)
    block_iterations: int = 20  # iterations per dynamic sub-node of the loop (the futures file of one block)
    # The trainer checkpoints a run keeps in the object store (weights, Adam's two moments in fp32, RNG: 12 to 16
    # bytes a parameter, a few TB a checkpoint of a frontier model). 0: every one, so a resume or a replay can start from any
    # iteration. K: the newest K, and of the older ones those written after a multiple of keep_checkpoints_every
    # iterations (0: none); each other one is pruned once K newer ones exist (miles_core/loop_plan.py `retired`), leaving a
    # tombstone that names why (tasks/retention.py). keep_policies false prunes the policy published from each pruned
    # checkpoint with it (2 bytes a parameter in bf16; its lineage manifest stays); true keeps every published policy.
    keep_checkpoints: int = 0
    keep_checkpoints_every: int = 0
    keep_policies: bool = True
    failure_emails: str = ""  # comma-separated addresses a recipe's launch plan notifies when a run fails, times out or is aborted

    def __post_init__(self):
        _check(0 <= self.retries <= 10, "cluster.retries", f"must be in [0, 10], got {self.retries}")
        _check(
            self.accelerator in ("", *ACCELERATORS),
            "cluster.accelerator",
            f"unknown GPU type {self.accelerator!r} (available: {', '.join(ACCELERATORS)})",
        )
        _check(self.gpu_platform in GPU_PLATFORMS, "cluster.gpu_platform", f"must be one of {', '.join(GPU_PLATFORMS)}, got {self.gpu_platform!r}")
        _check(
            not self.accelerator or self.gpu_platform == "cuda",
            "cluster.accelerator",
            f"{self.accelerator!r} is an NVIDIA GPU type, and cluster.gpu_platform is {self.gpu_platform}: leave accelerator empty",
        )
        for stage in TIMED_STAGES:
            minutes = getattr(self, f"{stage}_timeout_min")
            _check(1 <= minutes <= MAX_TIMEOUT_MIN, f"cluster.{stage}_timeout_min", f"must be in [1, {MAX_TIMEOUT_MIN}] minutes, got {minutes}")
        _check(0 <= self.max_restarts <= 100, "cluster.max_restarts", f"must be in [0, 100], got {self.max_restarts}")
        for name in ("rdzv_timeout_s", "rdzv_join_timeout_s"):
            _check(getattr(self, name) >= 1, f"cluster.{name}", f"must be >= 1 second, got {getattr(self, name)}")
        _check(1 <= self.block_iterations <= 200, "cluster.block_iterations", f"must be in [1, 200] (about 5 nodes each), got {self.block_iterations}")
        _check(self.keep_checkpoints >= 0, "cluster.keep_checkpoints", f"must be >= 0 (0 keeps every checkpoint), got {self.keep_checkpoints}")
        _check(self.keep_checkpoints_every >= 0, "cluster.keep_checkpoints_every", f"must be >= 0, got {self.keep_checkpoints_every}")
        _check(
            not self.keep_checkpoints_every or self.keep_checkpoints,
            "cluster.keep_checkpoints_every",
            "keeps every checkpoint already (cluster.keep_checkpoints is 0): set keep_checkpoints to the newest ones to keep",
        )
        _check(
            self.keep_policies or self.keep_checkpoints,
            "cluster.keep_policies",
            "false prunes a policy with its checkpoint, and cluster.keep_checkpoints is 0 (every checkpoint kept): set both",
        )
        for address in self.emails():
            _check(bool(_EMAIL.match(address)), "cluster.failure_emails", f"{address!r} is not an e-mail address")

    def emails(self) -> list[str]:
        return [a.strip() for a in self.failure_emails.split(",") if a.strip()]

    def timeout_s(self, stage: str) -> int:
        """The timeout of a stage's task (TIMED_STAGES), in seconds."""
        return 60 * getattr(self, f"{stage}_timeout_min")
