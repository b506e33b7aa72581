"""The rules that relate config keys of different meaning, in one table, checked whenever a RunConfig is built.

Each rule is (key path it reports, when it applies, what must hold, why). A section's own value
checks (ranges, finiteness, one key against its neighbour's bound) live in its dataclass; here are
the rules that need two sections, or two settings whose combination is wrong although each is
right: rollout log-probs with IS corrections, over-sampling without dynamic sampling, a backend
with a parallel size or an engine with a precision it does not read, parallel sizes with the model's shape,
async phases with what they do not run (a critic, a teacher) or stale samples without a correction, QAT without the quantized publish it trains for,
a GPU type without GPUs, routing replay without experts, distillation alone with what reads the task reward,
LoRA with what it does not run (an async phase, QAT, a quantized publish).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from miles_core.checkpoint import lora_map
from miles_core.checkpoint.arch import MOE_TP_REASON, megatron_refusal
from miles_core.config.base import ConfigError
from miles_core.config.model import DENSE_ARCHS


class Rule(NamedTuple):
    key: str
    applies: Callable  # (RunConfig) -> bool
    holds: Callable  # (RunConfig) -> bool
    reason: Callable  # (RunConfig) -> str, the message when it does not hold


def _async(c) -> bool:
    return c.async_phase.schedule != "sync"


def _megatron(c) -> bool:
    return c.train.backend == "megatron"


# (train.<size key>, the model dimension megatron splits over that many ranks)
PARALLEL_SPLITS = (
    ("tensor_parallel", "num_heads"),
    ("tensor_parallel", "num_kv_heads"),
    ("tensor_parallel", "intermediate_size"),
    ("pipeline_parallel", "num_layers"),
    ("expert_parallel", "num_experts"),
)


def check_parallel_fit(train, shape: dict[str, int], where: str) -> None:
    """Megatron's parallel sizes divide the model's dimensions (`shape`: the model section's, or what a
    checkpoint's config.json states, read at admission); `where` prefixes the model key in the message."""
    if train.backend != "megatron":
        return
    for size_key, model_key in PARALLEL_SPLITS:
        size = getattr(train, size_key)
        if size > 1 and model_key in shape and shape[model_key] % size:
            raise ConfigError(f"train.{size_key}: must divide {where}{model_key} ({shape[model_key]}): megatron splits it over {size} ranks")


def _megatron_lora(c) -> bool:
    return _megatron(c) and c.train.lora.rank > 0


def _tiny_shape(c) -> dict[str, int]:
    return {key: getattr(c.model, key) for _, key in PARALLEL_SPLITS}


def _torch_ignores(key: str, default):
    """A rule: the torch backend does not read train.<key>, so a value other than the default is refused, not ignored."""
    return Rule(
        f"train.{key}",
        lambda c: c.train.backend == "torch",
        lambda c: getattr(c.train, key) == default,
        lambda c: (
            f"{getattr(c.train, key)!r} is read by the megatron backend only (train.backend: torch holds the whole model in every process): "
            f"use {default!r} or train.backend: megatron"
        ),
    )


RULES: tuple[Rule, ...] = (
    Rule("algo.advantage", lambda c: c.algo.advantage == "rloo", lambda c: c.rollout.n_samples >= 2, lambda c: "rloo needs rollout.n_samples >= 2"),
    Rule(
        "algo.use_rollout_logprobs",
        lambda c: c.algo.use_rollout_logprobs,
        lambda c: c.algo.is_correction == "none",
        lambda c: (
            f"with algo.is_correction: {c.algo.is_correction} the train/inference mismatch would be corrected twice (the ratio to the "
            "rollout's log-probs already is the importance weight): set use_rollout_logprobs: false, or is_correction: none"
        ),
    ),
    Rule(
        "rollout.over_sample",
        lambda c: c.rollout.over_sample > 1,
        lambda c: c.rollout.dynamic_sampling,
        lambda c: (
            "over-sampling feeds dynamic sampling's filter (rollout.dynamic_sampling: true); without it the extra groups only wait, unfiltered "
            "and growing stale, in the buffer: set over_sample: 1 or dynamic_sampling: true"
        ),
    ),
    _torch_ignores("tensor_parallel", 1),
    _torch_ignores("pipeline_parallel", 1),
    _torch_ignores("expert_parallel", 1),
    Rule(
        "model.arch",
        lambda c: _megatron(c) and not c.model.path,
        lambda c: megatron_refusal({"model_type": c.model.arch}) is None,
        lambda c: f"{c.model.arch!r} cannot train on the megatron backend: {megatron_refusal({'model_type': c.model.arch})}; use train.backend: torch",
    ),
    Rule(
        "train.expert_parallel",
        lambda c: _megatron(c) and not c.model.path and c.model.arch not in DENSE_ARCHS and c.train.tensor_parallel > 1,
        lambda c: c.train.expert_parallel > 1,
        lambda c: MOE_TP_REASON,
    ),
    Rule(
        "train.expert_parallel",
        lambda c: c.train.expert_parallel > 1 and not c.model.path,
        lambda c: c.model.arch not in DENSE_ARCHS,
        lambda c: f"expert parallelism splits MoE experts, and model.arch {c.model.arch!r} has none: use 1 or an MoE arch (e.g. qwen3_moe)",
    ),
    # LoRA on the megatron backend (miles_core/train/megatron/lora.py); a user's checkpoint is checked when the trainer builds it
    Rule("train.lora.rank", lambda c: _megatron_lora(c) and not c.model.path, lambda c: c.model.arch in DENSE_ARCHS, lambda c: lora_map.MOE_REASON),
    Rule("train.lora.trainable", _megatron_lora, lambda c: not c.train.lora.full, lambda c: lora_map.TRAINABLE_REASON),
    Rule(
        "train.lora.dropout", lambda c: _megatron_lora(c) and c.train.tensor_parallel > 1, lambda c: not c.train.lora.dropout, lambda c: lora_map.DROPOUT_REASON
    ),
    Rule(
        "train.lora.target_modules",
        lambda c: _megatron_lora(c) and not c.model.path,
        lambda c: lora_map.target_refusal(c.train.lora, c.model.num_layers) is None,
        lambda c: lora_map.target_refusal(c.train.lora, c.model.num_layers),
    ),
    Rule(
        "async_phase.queue_size",
        _async,
        lambda c: c.async_phase.queue_size >= c.rollout.prompts_per_step,
        lambda c: f"must be >= rollout.prompts_per_step ({c.rollout.prompts_per_step}): the trainer takes that many groups per step",
    ),
    Rule(
        "async_phase.schedule",
        _async,
        lambda c: c.algo.advantage != "ppo",
        lambda c: "async phases do not train a critic yet: use a critic-free estimator or schedule: sync",
    ),
    Rule(
        "async_phase.rollout_workers",
        lambda c: _async(c) and c.rollout.engine == "sglang" and bool(c.rollout.sglang.urls.strip()),
        lambda c: c.async_phase.rollout_workers == 1,
        lambda c: "attached SGLang servers (rollout.sglang.urls) take weights from one rollout actor: set 1, or let each actor launch its own servers",
    ),
    Rule(
        "rollout.dtype",
        lambda c: c.rollout.engine == "sglang",
        lambda c: c.rollout.dtype == "float32",
        lambda c: f"{c.rollout.dtype!r} is read by the embedded torch engine only: an SGLang server computes in rollout.sglang.dtype (its --dtype)",
    ),
    Rule(
        "publish.quantization",
        lambda c: bool(c.publish.quantization),
        lambda c: c.rollout.engine == "torch",
        lambda c: (
            f"{c.publish.quantization} weights are computed with by the embedded torch engine; an SGLang server quantizes what it "
            "loads by its own flag (e.g. --quantization fp8 in rollout.sglang.extra_args): publish unquantized for it"
        ),
    ),
    Rule(
        "train.qat",
        lambda c: bool(c.train.qat),
        lambda c: c.publish.quantization == c.train.qat,
        lambda c: f"{c.train.qat} QAT trains against the weights the rollout computes with: set publish.quantization: {c.train.qat}, or qat: ''",
    ),
    Rule(
        "train.qat_group_size",
        lambda c: bool(c.train.qat) and c.publish.quantization == c.train.qat,
        lambda c: c.train.qat_group_size == c.publish.group_size,
        lambda c: f"must equal publish.group_size ({c.publish.group_size}): the trainer's groups of inputs are then the published weights' groups",
    ),
    Rule(
        "train.qat",
        lambda c: bool(c.train.qat),
        lambda c: c.train.backend == "torch",
        lambda c: (
            "the megatron backend does not fake-quantize its projections (megatron-core's linear layers, whose row-parallel input "
            "shards would each need whole groups): use train.backend: torch, or qat: ''"
        ),
    ),
    Rule(
        "train.lora.rank",
        lambda c: c.train.lora.rank > 0,
        lambda c: not _async(c),
        lambda c: (
            "an async phase pushes the trainer's full weights into the engines in memory, and a LoRA policy is its adapter "
            "alone, served over the base: train LoRA with async_phase.schedule: sync, or set rank: 0"
        ),
    ),
    Rule(
        "rollout.speculative_tokens",
        lambda c: c.rollout.speculative_tokens > 0 and c.rollout.engine == "sglang",
        lambda c: c.train.lora.rank == 0,
        lambda c: "a LoRA policy is published as its adapter alone, with no MTP head for SGLang's draft model: set train.lora.rank: 0",
    ),
    Rule(
        "train.qat",
        lambda c: bool(c.train.qat) and c.train.lora.rank > 0,
        lambda c: False,
        lambda c: "QAT fake-quantizes the weights the optimizer trains, and with train.lora the base weights are frozen: set qat: '' or lora.rank: 0",
    ),
    Rule(
        "publish.quantization",
        lambda c: bool(c.publish.quantization) and c.train.lora.rank > 0,
        lambda c: False,
        lambda c: (
            f"a LoRA policy is published as its adapter alone (docs/lora.md), which {c.publish.quantization} does not quantize: "
            "set quantization: '' or train.lora.rank: 0"
        ),
    ),
    Rule(
        "rollout.routing_replay",
        lambda c: c.rollout.routing_replay and not c.model.path,
        lambda c: c.model.arch not in DENSE_ARCHS,
        lambda c: f"routing replay records the experts each token is routed to, and model.arch {c.model.arch!r} has none: set it false or use an MoE arch",
    ),
    Rule(
        "async_phase.sync_iterations",
        _async,
        lambda c: c.async_phase.sync_iterations < c.iterations,
        lambda c: f"must be < iterations ({c.iterations}) so that an async phase runs",
    ),
    Rule(
        "cluster.accelerator",
        lambda c: bool(c.cluster.accelerator),
        lambda c: bool(c.train.gpus_per_node or c.rollout.gpus()),
        lambda c: f"{c.cluster.accelerator!r} is the type of the GPUs a pod asks for, and this recipe asks for none: set train.gpus_per_node or rollout GPUs",
    ),
    Rule(
        "cluster.gpu_platform",
        lambda c: c.cluster.gpu_platform == "rocm",
        lambda c: not c.rollout.gpus(),
        lambda c: (
            "the SGLang image is built for CUDA (containers/images.py): launch the SGLang servers on NVIDIA nodes, or attach ROCm ones by rollout.sglang.urls"
        ),
    ),
    Rule(
        "async_phase.take_timeout_s",
        _async,
        lambda c: c.async_phase.take_timeout_s < c.cluster.timeout_s("async"),
        lambda c: f"must be below cluster.async_timeout_min ({c.cluster.async_timeout_min} min): the task's own timeout would end the phase first",
    ),
    Rule(
        "distill.teacher",
        lambda c: bool(c.distill.teacher),
        lambda c: not _async(c),
        lambda c: (
            "the teacher scores a batch in its own task between score and train, which an async phase (one Ray job) does not run: "
            "distil with async_phase.schedule: sync"
        ),
    ),
    Rule(
        "distill.with_reward",
        lambda c: not c.distill.with_reward,
        lambda c: c.algo.advantage != "ppo",
        lambda c: (
            "PPO's critic learns the values of the task reward, which distillation alone does not train on: set with_reward: true or a critic-free algo.advantage"
        ),
    ),
    Rule(
        "distill.with_reward",
        lambda c: not c.distill.with_reward,
        lambda c: not c.rollout.dynamic_sampling,
        lambda c: (
            "dynamic sampling drops groups by the spread of the task reward, which distillation alone does not train on: set rollout.dynamic_sampling: false"
        ),
    ),
    Rule(
        "async_phase.max_staleness",
        lambda c: _async(c) and (c.async_phase.max_staleness > 0 or c.async_phase.partial_rollout),
        lambda c: c.algo.use_rollout_logprobs or c.algo.is_correction != "none",
        lambda c: (
            f"an async phase trains on samples up to {c.async_phase.max_staleness} weight versions old (and, with partial rollout, on tokens "
            "of older versions): without a correction the update takes them as the trainer's own policy's and is biased (measured: the "
            "reward collapses, docs/async.md). Set algo.use_rollout_logprobs: true (PPO's ratio and clip against the policy that generated "
            "them), or algo.is_correction: tis | mis (decoupled PPO: the ratio against the recomputed policy, weighted by its truncated or "
            "masked ratio to the generating policy, as Miles' TIS and AReaL), or max_staleness: 0"
        ),
    ),
)


def check_rules(cfg) -> None:
    """Raise ConfigError naming the key of the first rule `cfg` breaks. A user's checkpoint (model.path)
    has its shape checked against the parallel sizes when the run admits it (models.source.admit)."""
    for rule in RULES:
        if rule.applies(cfg) and not rule.holds(cfg):
            raise ConfigError(f"{rule.key}: {rule.reason(cfg)}")
    if not cfg.model.path:
        check_parallel_fit(cfg.train, _tiny_shape(cfg), where="model.")
