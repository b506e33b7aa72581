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
    tool_demo_fraction: float = 0.3  # tool_arith: share of demonstrations that call the python tool

    def __post_init__(self):
        _check(self.problem_set in ("addition", "tool_arith"), "data.problem_set", f"unknown problem set {self.problem_set!r} (available: addition, tool_arith)")
        _check(1 <= self.digits <= 6, "data.digits", f"must be in [1, 6], got {self.digits}")
        _check(self.train_size > 0 and self.test_size > 0, "data.train_size", "sizes must be > 0")
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
        _check(self.steps >= 0, "sft.steps", "must be >= 0")
        _check(self.batch_size > 0, "sft.batch_size", "must be > 0")
        _check(self.lr > 0, "sft.lr", "must be > 0")


WEIGHT_SYNC_MODES = ("disk", "distributed")
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(frozen=True)
class SGLangConfig:
    """SGLang rollout servers (rollout.engine: sglang); see miles_core/rollout/engines/sglang.py."""

    urls: str = ""  # comma-separated http://host:port of running servers to attach to; empty = launch
    num_servers: int = 1  # servers launched on 127.0.0.1 when urls is empty
    python: str = ""  # the SGLang environment's python; empty = $MILES_SGLANG_ENV or the `make sglang-env` cache path
    device: str = "cpu"  # cpu (SGLANG_USE_CPU_ENGINE=1 + the CPU stand-ins) | cuda
    max_total_tokens: int = 65536  # KV cache size in tokens (the CPU default would reserve 13 GB)
    dtype: str = "float32"
    extra_args: str = ""  # further launch_server arguments, space-separated
    startup_timeout_s: float = 300.0  # launch until /health answers
    request_timeout_s: float = 300.0  # any single HTTP call
    max_concurrency: int = 4  # /generate calls in flight per server
    max_batch_sequences: int = 64  # sequences per /generate call
    max_restarts: int = 2  # restarts of a dead launched server per engine before giving up
    weight_sync: str = "disk"  # disk: update_weights_from_disk | distributed: broadcast over a process group
    sync_backend: str = "gloo"  # process-group backend of distributed sync (nccl on GPUs)
    bucket_mb: float = 64.0  # distributed sync: flattened bucket size per broadcast
    pause_mode: str = "abort"  # how in-flight requests are paused for an update (aborted ones are resubmitted)
    sleep_on_idle: bool = True  # an idle scheduler otherwise polls at ~0.7 of a core (measured here), taking it from the trainer

    def __post_init__(self):
        _check(self.num_servers >= 1, "rollout.sglang.num_servers", "must be >= 1")
        _check(self.device in ("cpu", "cuda"), "rollout.sglang.device", f"must be cpu or cuda, got {self.device!r}")
        _check(self.max_total_tokens > 0, "rollout.sglang.max_total_tokens", "must be > 0")
        for name in ("startup_timeout_s", "request_timeout_s", "bucket_mb"):
            _check(getattr(self, name) > 0, f"rollout.sglang.{name}", "must be > 0")
        _check(self.max_concurrency >= 1 and self.max_batch_sequences >= 1, "rollout.sglang.max_concurrency", "max_concurrency and max_batch_sequences must be >= 1")
        _check(self.max_restarts >= 0, "rollout.sglang.max_restarts", "must be >= 0")
        _check(self.weight_sync in WEIGHT_SYNC_MODES, "rollout.sglang.weight_sync", f"must be one of {', '.join(WEIGHT_SYNC_MODES)}, got {self.weight_sync!r}")
        _check(self.sync_backend in ("gloo", "nccl"), "rollout.sglang.sync_backend", f"must be gloo or nccl, got {self.sync_backend!r}")
        _check(self.pause_mode in PAUSE_MODES, "rollout.sglang.pause_mode", f"must be one of {', '.join(PAUSE_MODES)}, got {self.pause_mode!r}")
        bad = [u for u in self.urls.split(",") if u.strip() and not u.strip().startswith(("http://", "https://"))]
        _check(not bad, "rollout.sglang.urls", f"not an http(s) URL: {bad[0] if bad else ''!r}")


ENGINES = ("torch", "sglang")


@dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn rollout with tools (miles_core/rollout/multi_turn.py), read when rollout.generate_fn
    is `miles_core.rollout.multi_turn:generate`; rollout.max_new_tokens caps each assistant turn."""

    max_turns: int = 3  # assistant turns per sample: at most max_turns - 1 tool calls
    max_response_tokens: int = 128  # budget of the whole response: the model's and the tools' tokens
    tools: str = "python,calc"  # tools the policy may call, comma-separated (miles_core.tools.TOOLS)
    max_tool_output_chars: int = 256  # a tool's output is cut to this before it becomes a turn
    tool_timeout_s: float = 5.0  # the python tool's wall-clock limit
    tool_cpu_s: int = 3
    tool_memory_mb: int = 256
    tool_workers: int = 2  # tool calls of one turn run concurrently

    def __post_init__(self):
        _check(self.max_turns >= 1, "rollout.multi_turn.max_turns", "must be >= 1")
        _check(self.max_response_tokens > 0, "rollout.multi_turn.max_response_tokens", "must be > 0")
        _check(all(t.strip() for t in self.tools.split(",")), "rollout.multi_turn.tools", f"empty tool name in {self.tools!r}")
        _check(self.max_tool_output_chars > 0, "rollout.multi_turn.max_tool_output_chars", "must be > 0")
        _check(self.tool_timeout_s > 0 and self.tool_cpu_s > 0 and self.tool_memory_mb > 0, "rollout.multi_turn.tool_timeout_s", "tool limits must be > 0")
        _check(self.tool_workers > 0, "rollout.multi_turn.tool_workers", "must be > 0")


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
    sglang: SGLangConfig = field(default_factory=SGLangConfig)  # used when engine is sglang
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # tools and turn limits of multi-turn generate

    def __post_init__(self):
        _check(self.engine in ENGINES, "rollout.engine", f"unknown engine {self.engine!r} (available: {', '.join(ENGINES)})")
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
    fallback: float = 0.0  # the reward of a sample whose reward function failed (clamped into [min, max])
    default_type: str = "math"  # rewards.hub:by_metadata's type when metadata has no reward_type
    remote_url: str = ""  # rewards.hub:remote's reward model endpoint (POST)
    remote_timeout_s: float = 10.0
    remote_retries: int = 2

    def __post_init__(self):
        _check(self.min < self.max, "reward.max", "must be > reward.min")
        _check(self.remote_timeout_s > 0, "reward.remote_timeout_s", "must be > 0")
        _check(self.remote_retries >= 0, "reward.remote_retries", "must be >= 0")


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
        _check(self.schedule in SCHEDULES, "async_phase.schedule", f"unknown schedule {self.schedule!r} (available: {', '.join(SCHEDULES)})")
        _check(self.sync_iterations >= 0, "async_phase.sync_iterations", "must be >= 0")
        _check(self.schedule == "mixed" or self.sync_iterations == 0, "async_phase.sync_iterations", "only the mixed schedule has sync iterations")
        for name in ("steps_per_phase", "update_weights_interval", "rollout_workers", "prompts_per_lease", "queue_size", "partial_segment_tokens", "threads_per_actor"):
            _check(getattr(self, name) >= 1, f"async_phase.{name}", "must be >= 1")
        _check(self.stale_policy in STALE_POLICIES, "async_phase.stale_policy", f"unknown policy {self.stale_policy!r} (available: drop, regenerate)")
        _check(self.max_staleness >= self.update_weights_interval - 1, "async_phase.max_staleness",
               f"must be >= update_weights_interval - 1 = {self.update_weights_interval - 1}, or the trainer waits for samples no actor can produce")
        _check(self.prompts_per_lease <= self.queue_size, "async_phase.prompts_per_lease", "must be <= async_phase.queue_size")
        _check(self.worker_cpus >= 0 and self.trainer_cpus >= 0, "async_phase.worker_cpus", "CPU reservations must be >= 0")
        _check(self.push_timeout_s > 0 and self.take_timeout_s > 0, "async_phase.push_timeout_s", "timeouts must be > 0")
        _check(self.max_restarts >= 0, "async_phase.max_restarts", "must be >= 0")


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
    async_phase: AsyncConfig = field(default_factory=AsyncConfig)

    def __post_init__(self):
        _check(bool(self.name) and "/" not in self.name, "name", f"must be a non-empty name without '/', got {self.name!r}")
        _check(self.iterations >= 1, "iterations", "must be >= 1")
        _check(self.algo.advantage != "rloo" or self.rollout.n_samples >= 2, "algo.advantage", "rloo needs rollout.n_samples >= 2")
        if self.async_phase.schedule != "sync":
            _check(self.async_phase.queue_size >= self.rollout.prompts_per_step, "async_phase.queue_size", f"must be >= rollout.prompts_per_step ({self.rollout.prompts_per_step}): the trainer takes that many groups per step")
            _check(self.algo.advantage != "ppo", "async_phase.schedule", "async phases do not train a critic yet: use a critic-free estimator or schedule: sync")
            _check(not self.rollout.dynamic_sampling, "async_phase.schedule", "async phases do not run dynamic sampling (rollout.dynamic_sampling)")
            _check(self.rollout.engine != "sglang" or not self.rollout.sglang.urls.strip() or self.async_phase.rollout_workers == 1, "async_phase.rollout_workers",
                   "attached SGLang servers (rollout.sglang.urls) take weights from one rollout actor: set 1, or let each actor launch its own servers")
            _check(self.async_phase.sync_iterations < self.iterations, "async_phase.sync_iterations", f"must be < iterations ({self.iterations}) so that an async phase runs")


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
