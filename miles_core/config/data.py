"""data and sft: the prompts and the supervised warm start."""

from __future__ import annotations

from dataclasses import dataclass

from miles_core.config.base import check as _check
from miles_core.config.base import check_finite


@dataclass(frozen=True)
class DataConfig:
    """Prompt data: a synthetic problem set, or the user's own jsonl/parquet prompt files."""

    problem_set: str = "addition"
    digits: int = 2  # operand size of the addition problem set
    train_size: int = 4000
    test_size: int = 256
    teacher_carry_error: float = 0.5  # chance the SFT demonstrator drops a carry (an imperfect teacher)
    teacher_samples: int = 8  # independent demonstrations per train problem
    train_file: str = ""  # user prompt files; empty = generate the problem set
    test_file: str = ""
    input_key: str = "input"
    label_key: str = "label"
    metadata_key: str = "metadata"
    seed: int = 0
    source_fn: str = "miles_core.data.source:PromptSource"  # plug-point: source(prompts, seed, state)
    tool_demo_fraction: float = 0.3  # tool_arith: share of demonstrations that call the python tool

    def __post_init__(self):
        check_finite(self, "data")
        _check(
            self.problem_set in ("addition", "tool_arith"), "data.problem_set", f"unknown problem set {self.problem_set!r} (available: addition, tool_arith)"
        )
        _check(1 <= self.digits <= 6, "data.digits", f"must be in [1, 6], got {self.digits}")
        _check(self.train_size > 0, "data.train_size", "must be > 0")
        _check(self.test_size > 0, "data.test_size", "must be > 0")
        _check(self.seed >= 0, "data.seed", "must be >= 0")
        _check(0.0 <= self.teacher_carry_error <= 1.0, "data.teacher_carry_error", "must be in [0, 1]")
        _check(self.teacher_samples > 0, "data.teacher_samples", "must be > 0")
        _check(0.0 <= self.tool_demo_fraction <= 1.0, "data.tool_demo_fraction", "must be in [0, 1]")
        _check(bool(self.train_file) == bool(self.test_file), "data.test_file", "give both train_file and test_file or neither")


@dataclass(frozen=True)
class SFTConfig:
    """Supervised warm start on the problem set's demonstrations."""

    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20
    seed: int = 0

    def __post_init__(self):
        check_finite(self, "sft")
        _check(self.steps >= 0, "sft.steps", "must be >= 0")
        _check(self.batch_size > 0, "sft.batch_size", "must be > 0")
        _check(self.lr > 0, "sft.lr", "must be > 0")
        _check(self.warmup_steps >= 0, "sft.warmup_steps", "must be >= 0")
        _check(self.seed >= 0, "sft.seed", "must be >= 0")
