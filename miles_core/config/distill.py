"""distill: on-policy distillation from a teacher checkpoint (docs/distillation.md).

The student (the policy) samples; the teacher scores the student's sampled tokens with its log-probs; the per-token
reverse KL estimate log pi_student(y_t) - log pi_teacher(y_t) trains the student (miles_core/algos/distill.py), as a
per-token advantage (`mode: kl`) or as a dense per-token reward whose returns are the advantage (`mode: reward`),
beside the task reward's advantage or alone (`with_reward`). An empty `teacher` turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_core.config.base import check as _check
from miles_core.config.base import check_finite
from miles_core.config.model import check_checkpoint_path

DISTILL_MODES = ("kl", "reward")
TEACHER_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class DistillConfig:
    teacher: str = ""  # the teacher's HF checkpoint, as model.path takes one (a directory or an object-store URI); "" = off
    mode: str = "kl"  # kl: -coef * reverse KL per token is the advantage | reward: ... is a dense reward, its returns the advantage
    coef: float = 1.0  # weight of the distillation term against the task reward's advantage
    with_reward: bool = True  # add the task reward's advantage (algo.advantage); false: distillation alone
    micro_batch_size: int = 128  # sequences per teacher forward pass
    dtype: str = "float32"  # the teacher's compute precision: float32 | bfloat16 (autocast, log-probs in fp32)

    def __post_init__(self):
        check_finite(self, "distill")
        check_checkpoint_path(self.teacher, "distill.teacher")
        _check(self.mode in DISTILL_MODES, "distill.mode", f"unknown mode {self.mode!r} (available: {', '.join(DISTILL_MODES)})")
        _check(self.coef > 0, "distill.coef", f"must be > 0, got {self.coef}")
        _check(self.micro_batch_size > 0, "distill.micro_batch_size", f"must be > 0, got {self.micro_batch_size}")
        _check(self.dtype in TEACHER_DTYPES, "distill.dtype", f"must be one of {', '.join(TEACHER_DTYPES)}, got {self.dtype!r}")
        _check(
            self.with_reward or bool(self.teacher),
            "distill.with_reward",
            "false leaves nothing to train on without a teacher: name distill.teacher, or set with_reward: true",
        )
