"""The cross-key rules table (miles_core/config/rules.py): each rule refuses what it names, with its key
path and the recipe file, and accepts the same recipe once the named fix is applied."""

from __future__ import annotations

import re

import pytest

from miles_core.config import AlgoConfig, ConfigError, RunConfig, load_recipe
from miles_core.config.rules import PARALLEL_SPLITS, RULES

MEGATRON = {"train.backend": "megatron"}
ASYNC = {"async_phase.schedule": "async", "algo.use_rollout_logprobs": True}
TEACHER = {"distill.teacher": "s3://models/teacher"}
LORA = {"train.lora.rank": 8}

# (id, overrides that break the rule, the error it must give, overrides on top that satisfy it)
CASES = [
    ("rloo_group", {"algo.advantage": "rloo", "rollout.n_samples": 1}, "algo.advantage: rloo needs rollout.n_samples >= 2", {"rollout.n_samples": 2}),
    (
        "rollout_logprobs_tis",
        {"algo.use_rollout_logprobs": True, "algo.is_correction": "tis"},
        "algo.use_rollout_logprobs: with algo.is_correction: tis the train/inference mismatch would be corrected twice",
        {"algo.is_correction": "none"},
    ),
    (
        "routing_replay_dense",
        {"rollout.routing_replay": True, "model.arch": "qwen3"},
        "rollout.routing_replay: routing replay records the experts each token is routed to, and model.arch 'qwen3' has none",
        {"model.arch": "qwen3_moe"},
    ),
    ("over_sample", {"rollout.over_sample": 1.5}, "rollout.over_sample: over-sampling feeds dynamic sampling's filter", {"rollout.dynamic_sampling": True}),
    ("torch_tp", {"train.tensor_parallel": 2}, "train.tensor_parallel: 2 is read by the megatron backend only", MEGATRON),
    ("torch_pp", {"train.pipeline_parallel": 2}, "train.pipeline_parallel: 2 is read by the megatron backend only", MEGATRON),
    ("torch_ep", {"train.expert_parallel": 2, "model.arch": "qwen3_moe"}, "train.expert_parallel: 2 is read by the megatron backend only", MEGATRON),
    # default model: 4 heads, 2 kv heads, intermediate 384, 4 layers, 8 experts
    (
        "tp_heads",
        {**MEGATRON, "train.nproc_per_node": 3, "train.tensor_parallel": 3},
        "train.tensor_parallel: must divide model.num_heads (4)",
        {"model.num_heads": 3, "model.num_kv_heads": 3, "model.hidden_size": 129},
    ),
    (
        "tp_kv_heads",
        {**MEGATRON, "train.nproc_per_node": 4, "train.tensor_parallel": 4},
        "train.tensor_parallel: must divide model.num_kv_heads (2)",
        {"model.num_kv_heads": 4},
    ),
    (
        "tp_ffn",
        {**MEGATRON, "train.tensor_parallel": 2, "model.intermediate_size": 385},
        "train.tensor_parallel: must divide model.intermediate_size (385)",
        {"model.intermediate_size": 386},
    ),
    (
        "pp_layers",
        {**MEGATRON, "train.pipeline_parallel": 2, "model.num_layers": 3},
        "train.pipeline_parallel: must divide model.num_layers (3)",
        {"model.num_layers": 6},
    ),
    (
        "tp_moe",
        {**MEGATRON, "train.tensor_parallel": 2, "model.arch": "qwen3_moe"},
        "train.expert_parallel: MoE layers at tensor parallel > 1 need expert parallel > 1",
        {"train.expert_parallel": 2},
    ),
    (
        "megatron_arch",
        {**MEGATRON, "model.arch": "qwen3_next"},
        "model.arch: 'qwen3_next' cannot train on the megatron backend: megatron-core 0.16.1 has Gated DeltaNet linear attention only as",
        {"model.arch": "glm4_moe"},
    ),
    (
        "ep_dense",
        {**MEGATRON, "train.expert_parallel": 2},
        "train.expert_parallel: expert parallelism splits MoE experts, and model.arch 'qwen2' has none",
        {"model.arch": "qwen3_moe"},
    ),
    (
        "ep_experts",
        {**MEGATRON, "train.expert_parallel": 2, "model.arch": "qwen3_moe", "model.num_experts": 3},
        "train.expert_parallel: must divide model.num_experts (3)",
        {"model.num_experts": 4},
    ),
    (
        "lora_megatron_moe",
        {**MEGATRON, **LORA, "model.arch": "qwen3_moe"},
        "train.lora.rank: the megatron backend adapts dense GQA layers only",
        {"model.arch": "qwen3"},
    ),
    (
        "lora_megatron_trainable",
        {**MEGATRON, **LORA, "train.lora.trainable": "lm_head"},
        "train.lora.trainable: the megatron backend trains the adapters only",
        {"train.lora.trainable": ""},
    ),
    (
        "lora_megatron_dropout_tp",
        {**MEGATRON, **LORA, "train.lora.dropout": 0.1, "train.tensor_parallel": 2},
        "train.lora.dropout: at tensor_parallel > 1 the megatron backend's adapters take no dropout",
        {"train.lora.dropout": 0.0},
    ),
    (
        "lora_megatron_fused",
        {**MEGATRON, **LORA, "train.lora.target_modules": "q_proj,v_proj"},
        "train.lora.target_modules: q_proj, k_proj and v_proj are one fused linear on the megatron backend, with one adapter",
        {"train.lora.target_modules": "q_proj,k_proj,v_proj"},
    ),
    (
        "async_queue",
        {**ASYNC, "async_phase.queue_size": 16},
        "async_phase.queue_size: must be >= rollout.prompts_per_step (32)",
        {"rollout.prompts_per_step": 16},
    ),
    ("async_critic", {**ASYNC, "algo.advantage": "ppo"}, "async_phase.schedule: async phases do not train a critic yet", {"algo.advantage": "grpo"}),
    (
        "async_uncorrected",
        {"async_phase.schedule": "async", "async_phase.max_staleness": 2},
        "async_phase.max_staleness: an async phase trains on samples up to 2 weight versions old",
        {"algo.is_correction": "tis"},
    ),
    (
        "quantized_sglang",
        {"publish.quantization": "fp8", "rollout.engine": "sglang"},
        "publish.quantization: fp8 weights are computed with by the embedded torch engine",
        {"rollout.engine": "torch"},
    ),
    ("qat_publish", {"train.qat": "int4"}, "train.qat: int4 QAT trains against the weights the rollout computes with", {"publish.quantization": "int4"}),
    (
        "qat_group_size",
        {"train.qat": "int4", "train.qat_group_size": 32, "publish.quantization": "int4"},
        "train.qat_group_size: must equal publish.group_size (128)",
        {"publish.group_size": 32},
    ),
    (
        "qat_megatron",
        {**MEGATRON, "train.qat": "int4", "publish.quantization": "int4"},
        "train.qat: the megatron backend does not fake-quantize its projections",
        {"train.backend": "torch"},
    ),
    (
        "rollout_dtype_sglang",
        {"rollout.dtype": "bfloat16", "rollout.engine": "sglang"},
        "rollout.dtype: 'bfloat16' is read by the embedded torch engine only",
        {"rollout.engine": "torch"},
    ),
    (
        "async_attached",
        {**ASYNC, "rollout.engine": "sglang", "rollout.sglang.urls": "http://h:1"},
        "async_phase.rollout_workers: attached SGLang servers",
        {"async_phase.rollout_workers": 1},
    ),
    (
        "async_sync_iterations",
        {**ASYNC, "async_phase.schedule": "mixed", "async_phase.sync_iterations": 3, "iterations": 3},
        "async_phase.sync_iterations: must be < iterations (3)",
        {"iterations": 4},
    ),
    (
        "accelerator_cpu",
        {"cluster.accelerator": "nvidia-h100"},
        "cluster.accelerator: 'nvidia-h100' is the type of the GPUs a pod asks for, and this recipe asks for none",
        {"train.gpus_per_node": 2},
    ),
    (
        "rocm_sglang_gpus",
        {"cluster.gpu_platform": "rocm", "rollout.engine": "sglang", "rollout.sglang.device": "cuda"},
        "cluster.gpu_platform: the SGLang image is built for CUDA",
        {"rollout.sglang.urls": "http://10.0.0.7:30000"},
    ),
    (
        "async_take_timeout",
        {**ASYNC, "cluster.async_timeout_min": 10},
        "async_phase.take_timeout_s: must be below cluster.async_timeout_min (10 min)",
        {"async_phase.take_timeout_s": 300.0},
    ),
    ("lora_async", {**ASYNC, "train.lora.rank": 4}, "train.lora.rank: an async phase pushes the trainer's full weights", {"async_phase.schedule": "sync"}),
    (
        "speculative_sglang_lora",
        {"rollout.engine": "sglang", "rollout.speculative_tokens": 2, "train.lora.rank": 4},
        "rollout.speculative_tokens: a LoRA policy is published as its adapter alone, with no MTP head",
        {"rollout.speculative_tokens": 0},
    ),
    (
        "lora_qat",
        {"train.lora.rank": 4, "train.qat": "int4", "publish.quantization": "int4"},
        "train.qat: QAT fake-quantizes the weights the optimizer trains, and with train.lora",
        {"train.lora.rank": 0},
    ),
    (
        "lora_quantized_publish",
        {"train.lora.rank": 4, "publish.quantization": "fp8"},
        "publish.quantization: a LoRA policy is published as its adapter alone",
        {"publish.quantization": ""},
    ),
    (
        "distill_async",
        {**ASYNC, **TEACHER},
        "distill.teacher: the teacher scores a batch in its own task between score and train, which an async phase",
        {"async_phase.schedule": "sync"},
    ),
    (
        "distill_alone_critic",
        {**TEACHER, "distill.with_reward": False, "algo.advantage": "ppo"},
        "distill.with_reward: PPO's critic learns the values of the task reward",
        {"algo.advantage": "grpo"},
    ),
    (
        "distill_alone_dynamic_sampling",
        {**TEACHER, "distill.with_reward": False, "rollout.dynamic_sampling": True},
        "distill.with_reward: dynamic sampling drops groups by the spread of the task reward",
        {"rollout.dynamic_sampling": False},
    ),
]


def recipe(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("name: rules\n")
    return path


@pytest.mark.parametrize("overrides, message, fix", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rule_refuses_with_its_key_and_accepts_the_fix(tmp_path, overrides, message, fix):
    path = recipe(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_recipe(path, overrides)
    assert str(err.value).startswith(f"{path}: {message}")
    assert isinstance(load_recipe(path, {**overrides, **fix}), RunConfig)


def test_every_rule_of_the_table_has_a_case():
    # each case breaks a different row: the messages name one distinct (key, reason) per rule and per parallel split
    assert len(CASES) == len(RULES) + len(PARALLEL_SPLITS)
    assert len({message for _, _, message, _ in CASES}) == len(CASES)
    assert {c[2].split(":")[0] for c in CASES} == {rule.key for rule in RULES} | {f"train.{size}" for size, _ in PARALLEL_SPLITS}


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "gpt_oss", "deepseek_v3", "kimi_k25"])
def test_every_moe_family_megatron_trains_takes_tensor_parallel_2_with_split_experts(tmp_path, arch):
    """Multi-latent attention (deepseek_v3, kimi_k25) included: its down-projections are whole on every rank."""
    tp2 = {**MEGATRON, "train.tensor_parallel": 2, "model.arch": arch}
    with pytest.raises(ConfigError, match="train.expert_parallel: MoE layers at tensor parallel > 1 need expert parallel > 1"):
        load_recipe(recipe(tmp_path), tp2)
    assert load_recipe(recipe(tmp_path), {**tp2, "train.expert_parallel": 2}).train.tensor_parallel == 2


def test_a_checkpoint_path_defers_the_shape_rules_to_its_admission(tmp_path):
    """model.path: the model section's sizes are unused, so the checkpoint's config.json is checked when the run admits it."""
    overrides = {**MEGATRON, "train.nproc_per_node": 3, "train.tensor_parallel": 3, "train.expert_parallel": 1}
    with pytest.raises(ConfigError, match="must divide model.num_heads"):
        load_recipe(recipe(tmp_path), overrides)
    assert load_recipe(recipe(tmp_path), {**overrides, "model.path": "s3://bucket/ckpt"}).model.path == "s3://bucket/ckpt"


def test_rules_also_hold_for_configs_built_in_code():
    with pytest.raises(ConfigError, match="algo.use_rollout_logprobs: with algo.is_correction: mis"):
        RunConfig(algo=AlgoConfig(use_rollout_logprobs=True, is_correction="mis"))


@pytest.mark.parametrize(
    "targets, words",
    [
        ("gate_proj,o_proj", "gate_proj and up_proj are one fused linear on the megatron backend"),
        ("q_proj,k_proj,v_proj,lm_head", "lm_head: not a projection the megatron backend adapts"),
        (r"re:.*layers\.0\..*", "must adapt the same projections in every layer on the megatron backend"),
        ("re:.*embed.*", "adapts no projection of the model"),
        ("all-linear", None),
        (r"re:.*mlp\..*_proj", None),
    ],
)
def test_megatron_lora_targets_whole_fused_projections_in_every_layer(tmp_path, targets, words):
    overrides = {**MEGATRON, **LORA, "train.lora.target_modules": targets}
    if words is None:
        assert load_recipe(recipe(tmp_path), overrides).train.lora.rank == 8
        return
    with pytest.raises(ConfigError, match=f"train.lora.target_modules: {re.escape(words)}"):
        load_recipe(recipe(tmp_path), overrides)
