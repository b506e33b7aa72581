"""HF <-> megatron-core conversion for each supported architecture, with the real megatron-core (CPU, gloo),
and the reason given for each family megatron does not train.

Each architecture: build the tiny HF model (sigmoid routers' correction biases, gpt-oss's sinks and expert biases
set to values that change the outputs, its SwiGLU clamp lowered to act), convert HF -> torch_dist -> HF, compare
the weights bitwise, compare megatron's logits with HF's on the same input in fp32 (longer than gpt-oss's sliding
window), and load the exported HF model (a multimodal checkpoint's text model).
"""

import tempfile

import pytest

from miles_core.weights.check import CheckpointError
from tests.megatron_runs import run_worker

LOGIT_TOLERANCE = 1e-5  # fp32, same weights: only the summation order of the two implementations differs
ARCHS = ["qwen2", "qwen3", "llama", "qwen3_moe", "deepseek_v2", "deepseek_v3", "kimi_k25", "glm4_moe", "glm4_moe_lite", "gpt_oss"]
BUILT_BY_THE_WORKER = {"deepseek_v2", "glm4_moe_lite"}  # no tiny family of the project: tests/megatron_worker.py builds it
FAMILY_ARCHS = [arch for arch in ARCHS if arch not in BUILT_BY_THE_WORKER]
# every other family of the project, and the words of its reason that name what megatron-core 0.16.1 lacks for it
REFUSED = {
    "deepseek_v32": "lightning indexer",
    "glm_moe_dsa": "lightning indexer",
    "deepseek_v4": "compressed sparse attention, hyper-connections and hash-routed first MoE layer",
    "glm5_next": "KDA linear-attention layers",
    "qwen3_next": "Gated DeltaNet",
    "qwen3_5": "Gated DeltaNet",
    "qwen3_5_moe": "Gated DeltaNet",
    "nemotron_h": "Mamba-2 layers",
    "minimax_m2": "q/k RMSNorm normalises all heads of a projection together",
    "llama4": "chunked local attention",
}


@pytest.fixture(scope="module")
def converted_root():
    with tempfile.TemporaryDirectory(prefix="megatron-convert-") as tmp:  # not pytest's rotated temp folders
        yield tmp


@pytest.fixture(scope="module")
def converted(converted_root):
    return run_worker("convert", converted_root, *ARCHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_conversion_round_trip_and_logits(arch, converted):
    result = converted[arch]
    assert result["same_names"] and result["bitwise"], result
    assert result["max_logit_diff"] < LOGIT_TOLERANCE, result
    assert result["exported_logits_equal"], result  # the exported directory is the same model to transformers
    assert result["logit_scale"] > 0.1  # the logits compared are not all ~0
    assert result["processes_left"] == []  # a save starts no helper process that outlives it (megatron-core's Manager)


def test_megatron_takes_the_torch_trainers_rl_steps(converted_root, converted):
    """One algorithm on two backends: three GRPO updates (lr 1e-2) on one batch from the same weights report the same
    losses and gradient norms and leave the same weights, up to summation order (a weight whose gradient is rounding
    alone, a key bias, takes Adam's step of about lr * 0.006 either way). The backends' learning runs
    (tests/flyte/test_learning.py) then differ by the samples each draws."""
    result = run_worker("vs_torch", converted_root, f"{converted_root}/qwen2/hf", f"{converted_root}/qwen2/mg")
    for (loss, norm), (torch_loss, torch_norm) in zip(result["megatron"], result["torch"]):
        assert loss == pytest.approx(torch_loss, abs=1e-6) and norm == pytest.approx(torch_norm, rel=1e-5), result
    assert len(result["weight_gap"]) == 3 and max(result["weight_gap"]) < 1e-3, result  # a wrong update moves weights by ~lr


def test_gpt_oss_logits_need_its_sinks_and_sliding_windows(converted):
    """The comparison above covers both: without the sinks, or with the windows opened, megatron's logits leave HF's."""
    result = converted["gpt_oss"]
    assert result["sequence"] > result["sliding_window"] > 0  # the window cuts the compared sequence
    assert result["without_sinks"] > 100 * LOGIT_TOLERANCE, result
    assert result["without_windows"] > 100 * LOGIT_TOLERANCE, result


def test_mapping_fuses_grouped_qkv_and_gate_up():
    """The pure mapping, without megatron: q/k/v interleave per KV group, gate/up stack, vocab pads."""
    import torch

    from miles_core.checkpoint.hf_megatron import ArchSpec, hf_to_megatron, megatron_to_hf

    spec = ArchSpec("qwen2", 5, 4, 1, 4, 2, 1, 3, 1e-6, 1e4, 16, True, True, False)
    hf = {
        "model.embed_tokens.weight": torch.randn(5, 4),
        "model.norm.weight": torch.ones(4),
        "model.layers.0.input_layernorm.weight": torch.ones(4),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(4),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(4, 4),
        "model.layers.0.mlp.gate_proj.weight": torch.full((3, 4), 1.0),
        "model.layers.0.mlp.up_proj.weight": torch.full((3, 4), 2.0),
        "model.layers.0.mlp.down_proj.weight": torch.randn(4, 3),
    }
    for name, rows, base in (("q", 4, 0), ("k", 2, 10), ("v", 2, 20)):
        hf[f"model.layers.0.self_attn.{name}_proj.weight"] = (base + torch.arange(rows)).float().unsqueeze(1).expand(rows, 4).clone()
        hf[f"model.layers.0.self_attn.{name}_proj.bias"] = (base + torch.arange(rows)).float()
    mg = hf_to_megatron(spec, hf)
    # two KV groups of [2 query heads, 1 key head, 1 value head], head_dim 1
    assert mg["decoder.layers.0.self_attention.linear_qkv.bias"].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert mg["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [1, 1, 1, 2, 2, 2]
    assert mg["embedding.word_embeddings.weight"].shape == (128, 4) and "output_layer.weight" not in mg
    back = megatron_to_hf(spec, mg)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_gpt_oss_experts_are_unstacked_transposed_and_deinterleaved():
    """The pure mapping of stacked gpt-oss experts: `x @ W` slices with gate columns even and up columns odd
    become each expert's [gate; up] rows, biases likewise, down_proj transposed; and back, bitwise."""
    import torch
    import transformers

    from miles_core.checkpoint.hf_megatron import arch_spec, hf_to_megatron, megatron_to_hf

    sizes = dict(vocab_size=5, hidden_size=4, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=2)
    config = transformers.GptOssConfig(**sizes, intermediate_size=2, num_local_experts=2, num_experts_per_tok=2)
    hf = {name: torch.randn(t.shape) for name, t in transformers.GptOssForCausalLM(config).state_dict().items()}
    experts = "model.layers.0.mlp.experts."
    hf[f"{experts}gate_up_proj_bias"] = torch.tensor([[0.0, 1, 2, 3], [4, 5, 6, 7]])
    mg = hf_to_megatron(arch_spec(config.to_dict()), hf)
    gate_up, expert1 = hf[f"{experts}gate_up_proj"][1], "decoder.layers.0.mlp.experts.local_experts.1."
    assert torch.equal(mg[f"{expert1}linear_fc1.weight"], torch.cat([gate_up[:, ::2].T, gate_up[:, 1::2].T]))
    assert mg[f"{expert1}linear_fc1.bias"].tolist() == [4, 6, 5, 7]  # [gate; up]
    assert torch.equal(mg[f"{expert1}linear_fc2.weight"], hf[f"{experts}down_proj"][1].T)
    assert torch.equal(mg["decoder.layers.0.self_attention.core_attention.softmax_offset"], hf["model.layers.0.self_attn.sinks"])
    back = megatron_to_hf(arch_spec(config.to_dict()), mg)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_unsupported_model_type_names_the_file(tmp_path):
    from miles_core.checkpoint.hf_megatron import read_arch

    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(CheckpointError, match=r"config.json: model_type 'gpt2' cannot train on the megatron backend: not a family the megatron"):
        read_arch(tmp_path)


def _family_config(arch: str) -> dict:
    """The config.json of the family's tiny checkpoint (no weights built)."""
    from miles_core.config import ModelConfig
    from miles_core.config.model import MIN_LAYERS
    from miles_core.models.families import FAMILIES, hf_config
    from miles_core.models.tiny import build_tokenizer, token_ids

    chat = FAMILIES[arch].chat
    cfg = ModelConfig(arch=arch, hidden_size=64, num_layers=MIN_LAYERS.get(arch, 2), num_experts=4, moe_intermediate_size=32)
    return hf_config(cfg, token_ids(chat, build_tokenizer(chat))).to_dict()


def test_every_family_is_converted_or_refused_by_name():
    from miles_core.config.model import MODEL_ARCHS

    assert set(MODEL_ARCHS) == set(FAMILY_ARCHS) | set(REFUSED)


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_a_family_megatron_cannot_train_is_refused_with_its_reason(arch):
    from miles_core.checkpoint.arch import REFUSALS, arch_spec, megatron_refusal

    config = _family_config(arch)
    reason = megatron_refusal(config)
    assert REFUSED[arch] in reason and reason == REFUSALS[arch]
    with pytest.raises(CheckpointError) as err:
        arch_spec(config, source="ckpt/config.json")
    assert str(err.value) == f"ckpt/config.json: model_type {config['model_type']!r} cannot train on the megatron backend: {reason}"


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_a_family_megatron_trains_has_no_refusal(arch):
    from miles_core.checkpoint.arch import megatron_refusal

    assert megatron_refusal(_family_config(arch)) is None


@pytest.mark.parametrize(
    "change, words",
    [
        ({"norm_topk_prob": False}, "always renormalises a sigmoid router's top-k weights"),
        ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 8, "n_routed_experts": 16}, "by its top num_experts_per_tok // topk_group (4)"),
        ({"attention_bias": True}, "builds multi-latent attention's down and output projections without biases"),
        ({"rope_interleave": False}, "always de-interleaves the RoPE part of each head"),
    ],
)
def test_a_deepseek_v3_setting_megatron_computes_differently_is_refused(change, words):
    from miles_core.checkpoint.arch import megatron_refusal

    assert words in megatron_refusal({**_family_config("deepseek_v3"), **change})


# as published on the model cards (deepseek-ai/DeepSeek-V3, zai-org/GLM-4.5): RoPE in the `rope_scaling` form of
# their config.json, settings the spec reads and the sizes it keeps
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "tie_word_embeddings": False,
}
GLM4_5 = {
    "model_type": "glm4_moe",
    "attention_bias": True,
    "head_dim": 128,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1536,
    "n_group": 1,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 92,
    "num_key_value_heads": 8,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_qk_norm": True,
    "vocab_size": 151552,
    "first_k_dense_replace": 3,
}


# openai/gpt-oss-20b's config.json, as a dequantized (bf16) copy has it: without the published MXFP4 quantization_config
GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "attention_bias": True,
    "head_dim": 64,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}


def test_the_published_gpt_oss_config_reads_as_windowed_gqa_with_sinks_yarn_and_biased_experts():
    from miles_core.checkpoint.arch import Yarn, arch_spec

    spec = arch_spec(GPT_OSS_20B)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rope_theta) == (64, 8, 64, 150000)
    assert spec.yarn == Yarn(factor=32.0, original_max_positions=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0, truncate=False)
    assert spec.attention_sinks and spec.qkv_bias and spec.linear_bias and spec.swiglu_limit == 7.0
    assert spec.sliding_window == 128 and spec.windowed_layers == tuple(range(0, 24, 2))
    assert (spec.num_experts, spec.moe_top_k, spec.moe_ffn_hidden_size, spec.moe_renormalize, spec.moe_sigmoid) == (32, 4, 2880, True, False)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"swiglu_alpha": 1.5}, "swiglu_alpha 1.5: megatron-core 0.16.1's quick_gelu fixes the gate's sigmoid scale at 1.702"),
        ({"attention_bias": False}, "attention_bias false: megatron-core 0.16.1's add_bias_linear gives the output projection a bias"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config (mxfp4): the conversion reads unquantized weights"),
    ],
)
def test_a_gpt_oss_setting_megatron_cannot_express_is_refused_naming_the_key(change, words):
    from miles_core.checkpoint.arch import megatron_refusal

    assert megatron_refusal(GPT_OSS_20B) is None
    assert megatron_refusal({**GPT_OSS_20B, **change}).startswith(words)


def test_the_published_deepseek_v3_config_reads_as_mla_with_grouped_sigmoid_routing_and_yarn():
    from miles_core.checkpoint.arch import MLA, Yarn, arch_spec

    spec = arch_spec(DEEPSEEK_V3)
    assert spec.mla == MLA(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    assert spec.yarn == Yarn(factor=40, original_max_positions=4096, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
    assert (spec.num_experts, spec.moe_top_k, spec.moe_groups, spec.moe_group_top_k) == (256, 8, 8, 4)
    assert (spec.moe_sigmoid, spec.moe_renormalize, spec.moe_scaling, spec.moe_shared_ffn_hidden_size, spec.dense_layers) == (True, True, 2.5, 2048, (0, 1, 2))
    assert [spec.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]


def test_the_published_glm4_5_config_reads_as_half_rotary_gqa_with_qk_norms_and_shared_experts():
    from miles_core.checkpoint.arch import arch_spec

    spec = arch_spec(GLM4_5)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rotary_fraction, spec.rope_theta) == (96, 8, 128, 0.5, 1e6)
    assert spec.qkv_bias and spec.qk_norm and spec.mla is None and spec.yarn is None
    assert (spec.num_experts, spec.moe_groups, spec.moe_shared_ffn_hidden_size, spec.dense_layers) == (160, 0, 1536, (0, 1, 2))


def test_a_rotary_scaling_the_conversion_does_not_map_is_refused():
    from miles_core.checkpoint.arch import megatron_refusal

    llama3 = {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert megatron_refusal(llama3) == "rope_type 'llama3': the conversion maps default RoPE for llama"
    assert "always rounds the correction range" in megatron_refusal({**DEEPSEEK_V3, "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "truncate": False}})


def test_a_bf16_export_keeps_the_sigmoid_routers_in_fp32(tmp_path):
    """The correction bias decides which experts win: published in bf16 it would route differently from the trainer."""
    import json

    import torch
    from safetensors.torch import load_file

    from miles_core.checkpoint.hf_megatron import hf_to_megatron, read_arch
    from miles_core.checkpoint.torch_dist import read_hf_state, write_hf
    from miles_core.config import ModelConfig
    from miles_core.models.tiny import build_tiny_model

    build_tiny_model(ModelConfig(arch="deepseek_v3", hidden_size=64, num_layers=2, num_experts=4, moe_intermediate_size=32), tmp_path / "hf")
    spec, hf = read_arch(tmp_path / "hf"), read_hf_state(tmp_path / "hf")
    write_hf(spec, hf_to_megatron(spec, hf), json.loads((tmp_path / "hf/config.json").read_text()), tmp_path / "out", "bfloat16")
    out = load_file(str(tmp_path / "out/model.safetensors"))
    fp32 = {name for name, t in out.items() if t.dtype == torch.float32}
    assert fp32 == {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"}
    assert all(t.dtype == torch.bfloat16 for name, t in out.items() if name not in fp32)


@pytest.mark.parametrize(
    "change, words",
    [
        ({}, None),
        ({"topk_method": "greedy", "n_group": 8, "topk_group": 3}, None),
        ({"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}, "by its top num_experts_per_tok // topk_group (2)"),
        ({"mlp_bias": True}, "the conversion maps MLPs without biases"),
        ({"topk_method": "noaux_tc"}, "routes greedy or group_limited_greedy only"),
    ],
)
def test_deepseek_v2_routing_is_mapped_as_transformers_runs_it_or_refused(change, words):
    """DeepSeek-V2 as published (V2: group-limited greedy top-6 of 3 groups; V2-Lite: greedy, no low-rank queries)."""
    from miles_core.checkpoint.arch import megatron_refusal

    v2 = {"model_type": "deepseek_v2", "num_experts_per_tok": 6, "q_lora_rank": None, "n_routed_experts": 64, "topk_method": "greedy", **change}
    reason = megatron_refusal(v2)
    assert reason is None if words is None else words in reason
