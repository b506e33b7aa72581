"""train, evaluation, publish, tracking, hooks, health: the trainer, what follows a step, and the gates on it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from miles_core.config.base import ConfigError, check_finite
from miles_core.config.base import check as _check


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (docs/lora.md): the base weights frozen, only the adapters (and `trainable`) in the optimizer, the
    adapter alone published and served unmerged. rank 0 trains every weight in full."""

    rank: int = 0
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, in training only
    target_modules: str = "all-linear"  # all-linear | comma-separated module names (a module whose path ends with one) | re:<regex over module paths>
    trainable: str = ""  # comma-separated module names trained in full beside the adapters (PEFT's modules_to_save), e.g. lm_head

    def __post_init__(self):
        check_finite(self, "train.lora")
        _check(self.rank >= 0, "train.lora.rank", f"must be >= 0 (0: no adapters, every weight trained), got {self.rank}")
        _check(self.alpha > 0, "train.lora.alpha", f"must be > 0, got {self.alpha}")
        _check(0 <= self.dropout < 1, "train.lora.dropout", f"must be in [0, 1), got {self.dropout}")
        _check(bool(self.target_modules.strip()), "train.lora.target_modules", "must name modules: all-linear, names or re:<regex>")
        if self.target_modules.startswith("re:"):
            try:
                re.compile(self.target_modules[3:])
            except re.error as err:
                raise ConfigError(f"train.lora.target_modules: not a regular expression: {err}") from err

    @property
    def targets(self) -> str | list[str]:
        """PEFT's target_modules: a regex string, "all-linear", or a list of names."""
        if self.target_modules.startswith("re:"):
            return self.target_modules[3:]
        return "all-linear" if self.target_modules == "all-linear" else [n.strip() for n in self.target_modules.split(",") if n.strip()]

    @property
    def full(self) -> list[str]:
        """The modules trained in full beside the adapters."""
        return [n.strip() for n in self.trainable.split(",") if n.strip()]


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
    dtype: str = "float32"  # float32 | bfloat16: the compute precision on either backend, fp32 master weights and Adam state (docs/precision.md)
    qat: str = ""  # "" | int4: the forward computes with fake-quantized int4 projection weights, gradients straight through (train/qat.py)
    qat_group_size: int = 128  # train.qat int4: inputs per scale, 32 | 128 (publish.group_size must agree)
    # megatron backend (megatron-core): parallel sizes; data parallel = nnodes x nproc_per_node / (tensor x pipeline)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1  # MoE experts split over this many ranks of a pipeline stage (its tensor x data parallel ranks)
    nnodes: int = 1  # nodes (pods) of the distributed train task
    nproc_per_node: int = 2  # processes of the distributed train task per node (one per GPU on a GPU node)
    gpus_per_node: int = 0  # GPUs requested by the distributed train task's pods (0 = CPU)
    memory_gb: int = 0  # host memory per train pod, GiB; 0 = 64 per GPU on GPU nodes, else the task's default
    lora: LoraConfig = field(default_factory=LoraConfig)  # rank > 0: LoRA adapters instead of full-parameter training
    mtp_lr: float = 0.0  # > 0: the MTP draft head trains on each step's rollout tokens at this AdamW rate (docs/speculative.md); 0 = off

    def __post_init__(self):
        check_finite(self, "train")
        _check(self.backend in ("torch", "megatron"), "train.backend", f"unknown backend {self.backend!r} (available: torch, megatron)")
        for name in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "nnodes", "nproc_per_node"):
            _check(getattr(self, name) >= 1, f"train.{name}", "must be >= 1")
        _check(
            self.gpus_per_node in (0, self.nproc_per_node),
            "train.gpus_per_node",
            f"must be 0 (CPU) or nproc_per_node={self.nproc_per_node} (one process per GPU)",
        )
        model_parallel, world = self.tensor_parallel * self.pipeline_parallel, self.nnodes * self.nproc_per_node
        _check(
            world % model_parallel == 0,
            "train.nproc_per_node",
            f"nnodes x nproc_per_node = {world} must be a multiple of tensor_parallel x pipeline_parallel = {model_parallel}",
        )
        _check(
            self.nproc_per_node % self.tensor_parallel == 0,
            "train.tensor_parallel",
            f"must divide nproc_per_node = {self.nproc_per_node}: a tensor-parallel group stays within a node (pipeline stages may span nodes)",
        )
        stage_ranks = self.nnodes * self.nproc_per_node // self.pipeline_parallel  # tensor x data parallel ranks of one pipeline stage
        _check(
            stage_ranks % self.expert_parallel == 0,
            "train.expert_parallel",
            f"must divide nnodes x nproc_per_node / pipeline_parallel = {stage_ranks}: megatron forms expert groups from a pipeline stage's "
            "tensor- and data-parallel ranks (expert tensor parallel 1)",
        )
        _check(self.dtype in ("float32", "bfloat16"), "train.dtype", f"must be float32 or bfloat16, got {self.dtype!r}")
        _check(self.lr > 0, "train.lr", "must be > 0")
        _check(self.grad_clip > 0, "train.grad_clip", "must be > 0")
        _check(self.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            _check(0 <= getattr(self, name) < 1, f"train.{name}", f"must be in [0, 1) (an Adam moment decay), got {getattr(self, name)}")
        _check(self.seed >= 0, "train.seed", "must be >= 0")
        _check(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        _check(self.mini_batches > 0, "train.mini_batches", "must be > 0")
        _check(self.micro_batch_size > 0, "train.micro_batch_size", "must be > 0")
        _check(self.memory_gb >= 0, "train.memory_gb", f"must be >= 0 (GiB; 0 = sized from the GPUs), got {self.memory_gb}")
        _check(self.qat in ("", "int4"), "train.qat", f"must be '' (off) or int4, got {self.qat!r}")
        _check(self.qat_group_size in INT4_GROUP_SIZES, "train.qat_group_size", f"must be one of {INT4_GROUP_SIZES}, got {self.qat_group_size}")
        _check(self.qat_group_size == 128 or self.qat == "int4", "train.qat_group_size", "is read by train.qat: int4 only: use 128")
        _check(self.mtp_lr >= 0, "train.mtp_lr", f"must be >= 0 (0: the draft head is not trained), got {self.mtp_lr}")
        _check(self.mtp_lr == 0 or self.backend == "torch", "train.mtp_lr", f"the draft head trains on the torch backend only, got backend {self.backend!r}")
        _check(self.mtp_lr == 0 or self.lora.rank == 0, "train.mtp_lr", "a draft head is not trained or published beside a LoRA adapter: set train.lora.rank 0")


@dataclass(frozen=True)
class EvalConfig:
    interval: int = 5  # evaluate every k iterations (and at the end)
    max_new_tokens: int = 8
    batch_size: int = 256
    fn: str = "miles_core.step:evaluate"  # plug-point: fn(engine, prompts, tokenizer, fns)

    def __post_init__(self):
        for name in ("interval", "max_new_tokens", "batch_size"):
            _check(getattr(self, name) > 0, f"evaluation.{name}", "must be > 0")


QUANTIZATIONS = ("", "fp8", "mxfp8", "int4")
INT4_GROUP_SIZES = (32, 128)  # inputs of a row that share one int4 scale (weights/int4.py)


@dataclass(frozen=True)
class PublishConfig:
    dtype: str = "float32"  # dtype of the published HF safetensors
    quantization: str = ""  # "" | fp8 (128 x 128 blocks) | mxfp8 | int4: the rollout engines' linear weights (weights/quantize.py)
    group_size: int = 128  # int4: inputs per scale, 32 | 128

    def __post_init__(self):
        _check(self.dtype in ("float32", "bfloat16", "float16"), "publish.dtype", f"unknown dtype {self.dtype!r}")
        _check(self.quantization in QUANTIZATIONS, "publish.quantization", f"must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        _check(self.group_size in INT4_GROUP_SIZES, "publish.group_size", f"must be one of {INT4_GROUP_SIZES}, got {self.group_size}")
        _check(self.group_size == 128 or self.quantization == "int4", "publish.group_size", "is read by publish.quantization: int4 only: use 128")

    @property
    def fmt(self) -> str:
        """The weights' format as weights/quantize.py names it ("" = unquantized)."""
        return f"int4-g{self.group_size}" if self.quantization == "int4" else self.quantization


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
class HealthConfig:
    """Gates on each training step (miles_core/health.py): one out of bounds stops the run before the step's weights are
    saved, naming the gate, its value and its threshold. 0 turns a gate off; NaN or infinity in the loss or the
    gradient norm always stops it."""

    max_mismatch_kl: float = 0.0  # KL(rollout || train) on the step's tokens, before its update (mismatch/kl_rollout_train)
    max_grad_norm: float = 0.0  # the largest gradient norm of the step's optimizer steps, before clipping
    min_reward_std: float = 0.0  # the batch's reward standard deviation: below it, every sample scores alike (collapse)
    max_staleness: int = 0  # async phase: policy versions between a sample's generation and the step that trains on it
    min_routing_agreement: float = 0.0  # R3: share of the rollout's experts the trainer's routers choose too (routing/agreement)

    def __post_init__(self):
        check_finite(self, "health")
        for key in ("max_mismatch_kl", "max_grad_norm", "min_reward_std", "max_staleness", "min_routing_agreement"):
            _check(getattr(self, key) >= 0, f"health.{key}", f"must be >= 0 (0: the gate is off), got {getattr(self, key)}")
        _check(self.min_routing_agreement <= 1, "health.min_routing_agreement", f"is a share of experts, at most 1, got {self.min_routing_agreement}")
