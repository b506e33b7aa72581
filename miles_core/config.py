"""Typed run configuration: frozen dataclasses with defaults; recipes (YAML) only override.

Every section checks its own values on construction (so a config that reaches a task through
Flyte is checked too); `load_recipe` also rejects unknown keys and wrong types, naming the key
path, before anything runs.  `python -m miles_core.config RECIPE` prints the resolved config as
JSON (what `pyflyte run ... --cfg` takes) or the error and exits 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A recipe or config value is wrong; the message names the file and key path."""


def _check(ok: bool, key: str, reason: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {reason}")


@dataclass(frozen=True)
class ModelConfig:
    """The tiny policy built from a seed (standard HF architecture, local tokenizer)."""

    arch: str = "qwen2"  # qwen2 | qwen3
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    seed: int = 0

    def __post_init__(self):
        _check(self.arch in ("qwen2", "qwen3"), "model.arch", f"must be qwen2 or qwen3, got {self.arch!r}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            _check(getattr(self, name) > 0, f"model.{name}", "must be > 0")
        _check(self.hidden_size % self.num_heads == 0, "model.hidden_size", "must be divisible by num_heads")
        _check(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", "must divide num_heads")


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

    def __post_init__(self):
        _check(self.problem_set == "addition", "data.problem_set", f"unknown problem set {self.problem_set!r}")
        _check(1 <= self.digits <= 6, "data.digits", f"must be in [1, 6], got {self.digits}")
        _check(self.train_size > 0 and self.test_size > 0, "data.train_size", "sizes must be > 0")
        _check(0.0 <= self.teacher_carry_error <= 1.0, "data.teacher_carry_error", "must be in [0, 1]")
        _check(self.teacher_samples > 0, "data.teacher_samples", "must be > 0")
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
        _check(self.steps >= 0, "sft.steps", "must be >= 0")
        _check(self.batch_size > 0, "sft.batch_size", "must be > 0")
        _check(self.lr > 0, "sft.lr", "must be > 0")


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "torch"
    prompts_per_step: int = 32
    n_samples: int = 8  # group size
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 8
    seed: int = 0
    generate_fn: str = "miles_core.loop:generate"  # plug-point: generate(engine, prompts, tokenizer, params)

    def __post_init__(self):
        _check(self.engine == "torch", "rollout.engine", f"unknown engine {self.engine!r} (available: torch)")
        _check(self.prompts_per_step > 0, "rollout.prompts_per_step", "must be > 0")
        _check(self.n_samples > 0, "rollout.n_samples", "must be > 0")
        _check(self.temperature > 0, "rollout.temperature", "must be > 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, "rollout.top_k", "must be >= 0")
        _check(self.max_new_tokens > 0, "rollout.max_new_tokens", "must be > 0")


@dataclass(frozen=True)
class RewardConfig:
    fn: str = "miles_core.rewards.math:integer_answer"  # dotted path "pkg.mod:fn"
    min: float = 0.0
    max: float = 1.0

    def __post_init__(self):
        _check(":" in self.fn, "reward.fn", f"must be a dotted path 'pkg.mod:fn', got {self.fn!r}")
        _check(self.min < self.max, "reward.max", "must be > reward.min")


@dataclass(frozen=True)
class AlgoConfig:
    advantage: str = "grpo"
    normalize_std: bool = True
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    use_rollout_logprobs: bool = False  # old policy = the rollout's log-probs instead of a recompute

    def __post_init__(self):
        _check(self.advantage == "grpo", "algo.advantage", f"unknown estimator {self.advantage!r} (available: grpo)")
        _check(self.eps_clip_low > 0 and self.eps_clip_high > 0, "algo.eps_clip_low", "clip ranges must be > 0")
        _check(self.kl_coef >= 0, "algo.kl_coef", "must be >= 0")
        _check(self.kl_type in ("k1", "k2", "low_var_kl"), "algo.kl_type", f"unknown KL estimator {self.kl_type!r}")


@dataclass(frozen=True)
class TrainConfig:
    backend: str = "torch"
    lr: float = 1e-3
    warmup_steps: int = 0  # linear learning-rate warm-up over the first optimizer steps
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    mini_batches: int = 1  # optimizer steps per rollout batch
    micro_batch_size: int = 128
    seed: int = 0

    def __post_init__(self):
        _check(self.backend == "torch", "train.backend", f"unknown backend {self.backend!r} (available: torch)")
        _check(self.lr > 0, "train.lr", "must be > 0")
        _check(self.grad_clip > 0, "train.grad_clip", "must be > 0")
        _check(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        _check(self.mini_batches > 0, "train.mini_batches", "must be > 0")
        _check(self.micro_batch_size > 0, "train.micro_batch_size", "must be > 0")


@dataclass(frozen=True)
class EvalConfig:
    interval: int = 5  # evaluate every k iterations (and at the end)
    max_new_tokens: int = 8
    batch_size: int = 256

    def __post_init__(self):
        _check(self.interval > 0, "evaluation.interval", "must be > 0")


@dataclass(frozen=True)
class PublishConfig:
    dtype: str = "float32"  # dtype of the published HF safetensors

    def __post_init__(self):
        _check(self.dtype in ("float32", "bfloat16", "float16"), "publish.dtype", f"unknown dtype {self.dtype!r}")


@dataclass(frozen=True)
class TrackingConfig:
    experiment: str = ""  # empty = the recipe name
    tracking_uri: str = ""  # empty = sqlite store under the run root


@dataclass(frozen=True)
class RunConfig:
    name: str = "tiny_arith_cpu"
    run_root: str = "runs"
    iterations: int = 20
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self):
        _check(bool(self.name) and "/" not in self.name, "name", f"must be a non-empty name without '/', got {self.name!r}")
        _check(self.iterations >= 1, "iterations", "must be >= 1")


def config_hash(obj) -> str:
    """A short stable hash of a config (section) for tags, paths and cache keys."""
    blob = json.dumps(dataclasses.asdict(obj), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def flatten(obj, prefix: str = "") -> dict[str, object]:
    """{"train.lr": 0.001, ...}: the flattened config, e.g. for MLflow params."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.update(flatten(value, key + "."))
        else:
            out[key] = value
    return out


def _build(cls, values: dict, path: str):
    if not isinstance(values, dict):
        raise ConfigError(f"{path or 'recipe'}: expected a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in known:
            raise ConfigError(f"{key_path}: unknown key (known: {', '.join(sorted(known))})")
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            kwargs[key] = _build(kind, value, key_path)
        else:
            kwargs[key] = _coerce(kind, value, key_path)
    return cls(**kwargs)


def _coerce(kind, value, key_path: str):
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[kind]
    if not ok:
        raise ConfigError(f"{key_path}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return kind(value)


def load_recipe(path: str | Path, overrides: dict | None = None) -> RunConfig:
    """Read a YAML recipe (overrides of the defaults), checked key by key; errors name the file."""
    path = Path(path)
    try:
        values = yaml.safe_load(path.read_text()) or {}
        for key, value in (overrides or {}).items():
            _set_dotted(values, key, value)
        cfg = _build(RunConfig, values, "")
    except FileNotFoundError:
        raise ConfigError(f"{path}: recipe file not found") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    return dataclasses.replace(cfg, run_root=str(Path(cfg.run_root).resolve()))


def _set_dotted(values: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        values = values.setdefault(key, {})
    values[last] = value


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m miles_core.config RECIPE.yaml [key=value ...]", file=sys.stderr)
        return 2
    overrides = {k: yaml.safe_load(v) for k, v in (arg.split("=", 1) for arg in argv[1:])}
    try:
        cfg = load_recipe(argv[0], overrides)
    except ConfigError as err:
        print(f"bad recipe: {err}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
