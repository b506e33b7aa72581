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


MODEL_ARCHS = ("qwen2", "qwen3", "llama", "qwen3_moe")


@dataclass(frozen=True)
class ModelConfig:
    """The tiny policy built from a seed (standard HF architecture, local tokenizer)."""

    arch: str = "qwen2"  # qwen2 | qwen3 | llama | qwen3_moe
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    seed: int = 0
    num_experts: int = 8  # qwen3_moe: routed experts per MoE layer
    moe_top_k: int = 2  # qwen3_moe: experts per token
    moe_intermediate_size: int = 64  # qwen3_moe: each expert's FFN width

    def __post_init__(self):
        _check(self.arch in MODEL_ARCHS, "model.arch", f"must be one of {', '.join(MODEL_ARCHS)}, got {self.arch!r}")
        _check(self.num_experts >= 2 and self.moe_intermediate_size > 0, "model.num_experts", "need num_experts >= 2 and moe_intermediate_size > 0")
        _check(1 <= self.moe_top_k <= self.num_experts, "model.moe_top_k", f"must be in [1, num_experts={self.num_experts}]")
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
    source_fn: str = "miles_core.data.source:PromptSource"  # plug-point: source(prompts, seed, state)

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
    # sampling control (DAPO dynamic sampling): keep generating until prompts_per_step groups pass
    # the filter, at most max_rounds rounds; each round asks for over_sample x the missing groups;
    # groups beyond the batch wait in a buffer for the next step
    dynamic_sampling: bool = False
    over_sample: float = 1.0
    max_rounds: int = 4
    rollout_fn: str = "miles_core.loop:rollout"  # plug-point: rollout(engine, source, tokenizer, cfg, scorer, buffer, seed)
    dynamic_filter_fn: str = "miles_core.algos.filters:nonzero_reward_std"  # plug-point: filter(group)
    buffer_filter_fn: str = "miles_core.algos.filters:oldest_first"  # plug-point: take(buffer, n)

    def __post_init__(self):
        _check(self.engine == "torch", "rollout.engine", f"unknown engine {self.engine!r} (available: torch)")
        _check(self.prompts_per_step > 0, "rollout.prompts_per_step", "must be > 0")
        _check(self.n_samples > 0, "rollout.n_samples", "must be > 0")
        _check(self.temperature > 0, "rollout.temperature", "must be > 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, "rollout.top_k", "must be >= 0")
        _check(self.max_new_tokens > 0, "rollout.max_new_tokens", "must be > 0")
        _check(self.over_sample >= 1.0, "rollout.over_sample", "must be >= 1")
        _check(self.max_rounds >= 1, "rollout.max_rounds", "must be >= 1")


@dataclass(frozen=True)
class RewardConfig:
    fn: str = "miles_core.rewards.math:integer_answer"  # plug-point: fn(response, label, metadata)
    min: float = 0.0
    max: float = 1.0
    group_fn: str = "miles_core.rewards.base:each_sample"  # plug-point: group_fn(reward_fn, responses, label, metadata)
    post_fn: str = "miles_core.rewards.base:no_post_processing"  # plug-point: post_fn(samples, group_size)

    def __post_init__(self):
        _check(self.min < self.max, "reward.max", "must be > reward.min")


ADVANTAGES = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
POLICY_LOSSES = ("ppo", "gspo", "cispo")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


@dataclass(frozen=True)
class AlgoConfig:
    advantage: str = "grpo"  # grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | ppo (GAE + critic)
    normalize_std: bool = True  # grpo: divide by the group std (False = Dr.GRPO)
    policy_loss: str = "ppo"  # ppo (token clip) | gspo (sequence ratio) | cispo
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    dual_clip: float = 0.0  # > 1 bounds negative-advantage tokens' loss at -c * A; 0 = off
    loss_aggregation: str = "token-mean"
    aggregation_horizon: int = 0  # seq-mean-token-sum-norm's constant; 0 = rollout.max_new_tokens
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    kl_unbiased: bool = False  # weight the KL estimate by pi / pi_old (DeepSeek-V3.2)
    kl_in_reward: bool = False  # shape the reward with -kl_coef * KL instead of a KL loss
    entropy_coef: float = 0.0
    gamma: float = 1.0  # discount of token-level returns (reinforce_plus_plus, ppo)
    lam: float = 0.95  # GAE lambda
    value_clip: float = 0.2
    critic_lr: float = 1e-3
    critic_warmup_steps: int = 0  # first iterations train the critic only
    use_rollout_logprobs: bool = False  # old policy = the rollout's log-probs instead of a recompute
    is_correction: str = "none"  # none | tis | mis: train/inference mismatch importance weights
    is_level: str = "token"  # token | sequence
    is_lower: float = 0.5
    is_upper: float = 2.0
    advantage_fn: str = "miles_core.algos.objective:compute_advantages"  # plug-point
    loss_fn: str = "miles_core.algos.objective:policy_loss"  # plug-point
    is_correction_fn: str = "miles_core.algos.objective:is_weights"  # plug-point
    sample_filter_fn: str = "miles_core.algos.filters:keep_all"  # plug-point: keep(sample) -> bool

    def __post_init__(self):
        _check(self.advantage in ADVANTAGES, "algo.advantage", f"unknown estimator {self.advantage!r} (available: {', '.join(ADVANTAGES)})")
        _check(self.policy_loss in POLICY_LOSSES, "algo.policy_loss", f"unknown loss {self.policy_loss!r} (available: {', '.join(POLICY_LOSSES)})")
        _check(self.loss_aggregation in AGGREGATIONS, "algo.loss_aggregation", f"unknown mode {self.loss_aggregation!r} (available: {', '.join(AGGREGATIONS)})")
        _check(self.eps_clip_low > 0 and self.eps_clip_high > 0, "algo.eps_clip_low", "clip ranges must be > 0")
        _check(self.dual_clip == 0 or self.dual_clip > 1, "algo.dual_clip", "must be 0 (off) or > 1")
        _check(self.aggregation_horizon >= 0, "algo.aggregation_horizon", "must be >= 0")
        _check(self.kl_coef >= 0, "algo.kl_coef", "must be >= 0")
        _check(self.kl_type in KL_TYPES, "algo.kl_type", f"unknown KL estimator {self.kl_type!r} (available: {', '.join(KL_TYPES)})")
        _check(0 < self.gamma <= 1 and 0 <= self.lam <= 1, "algo.gamma", "gamma must be in (0, 1] and lam in [0, 1]")
        _check(self.value_clip > 0 and self.critic_lr > 0, "algo.value_clip", "value_clip and critic_lr must be > 0")
        _check(self.critic_warmup_steps >= 0, "algo.critic_warmup_steps", "must be >= 0")
        _check(self.is_correction in ("none", "tis", "mis"), "algo.is_correction", f"unknown correction {self.is_correction!r} (available: none, tis, mis)")
        _check(self.is_level in ("token", "sequence"), "algo.is_level", f"must be token or sequence, got {self.is_level!r}")
        _check(0 <= self.is_lower < 1 < self.is_upper, "algo.is_upper", "need 0 <= is_lower < 1 < is_upper")


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
    # megatron backend (megatron-core): parallel sizes; data parallel = nproc_per_node / (tensor x pipeline)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1  # MoE experts split over this many data-parallel ranks
    nproc_per_node: int = 2  # processes of the distributed train task (one per GPU on a GPU node)
    megatron_dtype: str = "float32"  # float32 | bfloat16 (parameters and compute; grads reduced in fp32)
    gpus_per_node: int = 0  # GPUs requested by the distributed train task's pods (0 = CPU)

    def __post_init__(self):
        _check(self.backend in ("torch", "megatron"), "train.backend", f"unknown backend {self.backend!r} (available: torch, megatron)")
        for name in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "nproc_per_node"):
            _check(getattr(self, name) >= 1, f"train.{name}", "must be >= 1")
        _check(self.gpus_per_node in (0, self.nproc_per_node), "train.gpus_per_node", f"must be 0 (CPU) or nproc_per_node={self.nproc_per_node} (one process per GPU)")
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        _check(self.nproc_per_node % model_parallel == 0, "train.nproc_per_node", f"must be a multiple of tensor_parallel x pipeline_parallel = {model_parallel}")
        _check((self.nproc_per_node // model_parallel) % self.expert_parallel == 0, "train.expert_parallel", "must divide the data-parallel size (nproc_per_node / (tensor x pipeline))")
        _check(self.megatron_dtype in ("float32", "bfloat16"), "train.megatron_dtype", f"must be float32 or bfloat16, got {self.megatron_dtype!r}")
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
    fn: str = "miles_core.loop:evaluate"  # plug-point: fn(engine, prompts, tokenizer, reward_fn, reward, cfg, generate_fn)

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
class HooksConfig:
    """Plug-points called around the training step; signatures in miles_core/hooks.py."""

    before_train_step: str = "miles_core.hooks:before_train_step"
    after_train_step: str = "miles_core.hooks:after_train_step"
    after_save: str = "miles_core.hooks:after_save"
    rollout_log: str = "miles_core.hooks:rollout_log"


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
    hooks: HooksConfig = field(default_factory=HooksConfig)

    def __post_init__(self):
        _check(bool(self.name) and "/" not in self.name, "name", f"must be a non-empty name without '/', got {self.name!r}")
        _check(self.iterations >= 1, "iterations", "must be >= 1")
        _check(self.algo.advantage != "rloo" or self.rollout.n_samples >= 2, "algo.advantage", "rloo needs rollout.n_samples >= 2")
        _check(self.algo.advantage != "ppo" or self.train.backend == "torch", "algo.advantage", f"ppo's critic runs on the torch backend, not {self.train.backend!r}")


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


def _read_values(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A recipe's values; `extends: other.yaml` (relative to the recipe) is read first and overridden."""
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict) or "extends" not in values:
        return values
    base = (path.parent / str(values.pop("extends"))).resolve()
    if base in seen:
        raise ConfigError(f"extends: {base} is extended in a cycle")
    try:
        return _merge(_read_values(base, (*seen, base)), values)
    except FileNotFoundError:
        raise ConfigError(f"extends: recipe file {base} not found") from None


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_recipe(path: str | Path, overrides: dict | None = None) -> RunConfig:
    """Read a YAML recipe (overrides of the defaults), checked key by key; errors name the file."""
    path = Path(path)
    try:
        values = _read_values(path.resolve())
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
    from miles_core.plugins import PluginError, check_plugins  # imports the plug-points' modules (torch)

    try:
        cfg = load_recipe(argv[0], overrides)
        check_plugins(cfg)
    except (ConfigError, PluginError) as err:
        print(f"bad recipe: {err}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
