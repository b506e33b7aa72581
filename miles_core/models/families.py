"""Every supported model family at tiny size: its transformers config class, checkpoint class and prompt format.

`FAMILIES[arch]` builds the tiny HF config of `model.arch` from the ModelConfig's sizes (hidden size,
layers, heads, experts) with the family's own transformers config class, keeping what makes the family
itself so the tiny model runs the same code paths as the published one: MoE with shared experts and
dense first layers, MLA, DeepSeek sparse attention's indexer, sliding windows and attention sinks,
chunked attention and NoPE layers, hybrid linear attention (Gated DeltaNet, KDA, Mamba-2),
hyper-connections, compressed attention.  Lengths shrink with the model (sliding window 8,
compression every 4/8 tokens, indexer top-16) so short test sequences reach those paths.
A vision-language family is saved as its full multimodal checkpoint with a one-block vision tower
(miles_core/models/multimodal.py), as a user would hold it; `miles_core.models.loading.load_causal_lm` gives
its text causal LM to the trainer and the rollout engine.  `model.arch` values and the layers each
family needs are in miles_core/config/model.py.

Findings with transformers 5.24 on CPU, all families build, load, generate and train here:

| family | finding | what is done |
|---|---|---|
| deepseek_v4 | the compressor groups cache slots into windows by their index in the batch, so a left-padded row is compressed differently from the same row unpadded | `needs_equal_length_batches`: the torch engine decodes it in batches of equal prompt length |
| deepseek_v32, deepseek_v4, glm_moe_dsa, glm5_next | the DSA indexers score keys by sums of ReLU'd dot products; where every head is negative the score is exactly 0, and which tied key top-k keeps depends on the length of the score row: a cached decode, a full forward pass and one over a longer sequence choose differently (with 2-4 indexer heads a tiny model's log-probs differed by up to 0.13, and appending a token changed earlier positions) | 16 indexer heads (published models have 32-64) |
| glm5_next | no text-only causal LM class exists (only `Glm5NextForConditionalGeneration`) | its multimodal class is the causal LM, vision tower frozen |
| glm5_next | a shared DSA layer reuses the top-k of the layer right before it; a linear-attention layer in between resets it (ValueError) | indexed layers come in pairs (full, shared) |
| llama4 | NoPE layers' attention temperature counts positions from the cache index, not position_ids, so left padding shifts it; `Llama4ForConditionalGeneration.forward` on text alone raises AttributeError (`image_outputs`) | published floor_scale 8192 (no effect below 8k tokens); the text causal LM is used |
| deepseek_v3, deepseek_v32, kimi_k25, glm_moe_dsa, minimax_m2, qwen3_next | the config classes neither write nor read keys the published config.json carries (DeepSeek routing: moe_layer_freq, topk_method, scoring_func; MiniMax-M2: QK norm and routing bias; Qwen3-Next: full_attention_interval), which SGLang needs | `PUBLISHED_KEYS` are written into the tiny config |
| all | `save_pretrained` writes the published checkpoint layout (per-expert tensors, original prefixes), not the module names | `check_hf_dir` compares against that layout |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import transformers

from miles_core.config import ModelConfig
from miles_core.models import chat_formats as formats
from miles_core.models import multimodal
from miles_core.models.chat_formats import ChatFormat

MAX_POSITIONS = 512
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# YaRN as the DeepSeek and gpt-oss checkpoints use it, scaled to the tiny context
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0}


@dataclass(frozen=True)
class Family:
    """arch -> how its tiny checkpoint is built. `text_config(cfg, ids)` gives the causal LM's config;
    `multimodal(text, cfg, ids)`, for a vision-language family, wraps it into the checkpoint's config."""

    chat: ChatFormat
    model_class: str  # the transformers class saved (the multimodal one for a vision-language family)
    text_config: Callable[[ModelConfig, dict], transformers.PretrainedConfig]
    multimodal: Callable[[transformers.PretrainedConfig, ModelConfig, dict], transformers.PretrainedConfig] | None = None


def base_fields(cfg: ModelConfig, ids: dict, tie: bool = False) -> dict:
    """The fields every family's config shares; `ids` maps token roles (pad, eos, bos) and special tokens to ids."""
    eos = [ids["eos"], ids["tool_call_end"]] if "tool_call_end" in ids else ids["eos"]
    return {
        "vocab_size": ids["vocab"],
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": tie,
        "bos_token_id": ids.get("bos", ids["pad"]),
        "eos_token_id": eos,
        "pad_token_id": ids["pad"],
        "dtype": "float32",
    }


def _head_dim(cfg: ModelConfig) -> int:
    return cfg.hidden_size // cfg.num_heads


def _gqa(cfg: ModelConfig) -> dict:
    """Grouped-query attention heads of the ModelConfig's head size."""
    return {"num_key_value_heads": cfg.num_kv_heads, "head_dim": _head_dim(cfg)}


def _local_experts(cfg: ModelConfig) -> dict:
    """Routed experts as gpt-oss, MiniMax and Llama 4 name them (`intermediate_size` is an expert's width)."""
    return {"intermediate_size": cfg.moe_intermediate_size, "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_top_k}


def _dense(cfg: ModelConfig, ids: dict, tie: bool = False) -> dict:
    return {**base_fields(cfg, ids, tie), "intermediate_size": cfg.intermediate_size, "num_key_value_heads": cfg.num_kv_heads}


def _every(n: int, interval: int, kind: str, other: str) -> list[str]:
    """`kind` every `interval` layers (every n-th when there are fewer), `other` elsewhere: the last layer is `kind`."""
    step = min(interval, n)
    return [kind if (i + 1) % step == 0 else other for i in range(n)]


def _legacy(config_class: type, tie: bool, **extra) -> Callable:
    """The first tiny builds (qwen2, qwen3, llama, qwen3_moe), field for field as the main recipes have them."""

    def build(cfg: ModelConfig, ids: dict) -> transformers.PretrainedConfig:
        fields = {**_dense(cfg, ids, tie), "rope_parameters": dict(ROPE), "bos_token_id": ids["pad"]}
        if config_class is not transformers.Qwen2Config:
            fields["head_dim"] = _head_dim(cfg)
        if config_class is transformers.Qwen3MoeConfig:
            fields.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_top_k, moe_intermediate_size=cfg.moe_intermediate_size)
        return config_class(**fields, **extra)

    return build


def _experts(cfg: ModelConfig) -> dict:
    """DeepSeek-style routed experts with one shared expert and grouped routing (two groups where they fit)."""
    groups = 2 if cfg.num_experts % 2 == 0 and cfg.moe_top_k <= cfg.num_experts // 2 else 1
    return {
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_shared_experts": 1,
        "n_group": groups,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
    }


def _mla(cfg: ModelConfig) -> dict:
    """Multi-head latent attention: low-rank query and key-value projections, a decoupled RoPE slice."""
    d = _head_dim(cfg)
    return {
        "num_key_value_heads": cfg.num_heads,
        "q_lora_rank": 3 * cfg.hidden_size // 4,
        "kv_lora_rank": cfg.hidden_size // 2,
        "qk_nope_head_dim": d,
        "qk_rope_head_dim": d // 2,
        "v_head_dim": d,
    }


# DeepSeek sparse attention's indexer: many heads (see the findings table), top-16 keys per query
def _dsa(cfg: ModelConfig) -> dict:
    return {"index_n_heads": 16, "index_head_dim": 2 * _head_dim(cfg), "index_topk": 16}


def _deepseek_v3(cfg, ids):
    return transformers.DeepseekV3Config(
        **base_fields(cfg, ids), **_mla(cfg), **_experts(cfg), intermediate_size=cfg.intermediate_size, rope_parameters=dict(YARN)
    )


def _deepseek_v32(cfg, ids):
    return transformers.DeepseekV32Config(
        **base_fields(cfg, ids), **_mla(cfg), **_experts(cfg), **_dsa(cfg), intermediate_size=cfg.intermediate_size, rope_parameters=dict(YARN)
    )


def _glm_moe_dsa(cfg, ids):
    """GLM-5: MLA + DSA with indexers alternating between computing (full) and reusing (shared) their selection."""
    experts = {**_experts(cfg), "n_group": 1}
    indexers = ["full" if i % 2 == 0 else "shared" for i in range(cfg.num_layers)]
    return transformers.GlmMoeDsaConfig(
        **base_fields(cfg, ids),
        **_mla(cfg),
        **experts,
        **_dsa(cfg),
        intermediate_size=cfg.intermediate_size,
        indexer_types=indexers,
        rope_parameters=dict(ROPE),
    )


def _deepseek_v4(cfg, ids):
    """DeepSeek-V4: one sliding, one compressed-sparse and one heavily-compressed attention layer (then alternating),
    hash-routed first MoE layer, hyper-connections, grouped output projection, shared-KV MQA with attention sinks."""
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    layers = [kinds[min(i, 2)] if i < 3 else kinds[1 + i % 2] for i in range(cfg.num_layers)]
    return transformers.DeepseekV4Config(
        **base_fields(cfg, ids),
        num_key_value_heads=1,
        head_dim=2 * _head_dim(cfg),
        q_lora_rank=cfg.hidden_size // 2,
        n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        moe_intermediate_size=cfg.moe_intermediate_size,
        layer_types=layers,
        mlp_layer_types=["hash_moe"] + ["moe"] * (cfg.num_layers - 1),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=8,
        o_groups=2,
        o_lora_rank=cfg.hidden_size // 4,
        index_n_heads=16,  # see the DSA tie in the findings table
        index_head_dim=2 * _head_dim(cfg),
        index_topk=4,
    )


def _glm4_moe(cfg, ids):
    """GLM-4.5: GQA with biased projections and half-rotary heads, sigmoid-routed experts with a shared expert."""
    return transformers.Glm4MoeConfig(
        **_dense(cfg, ids),
        **{k: v for k, v in _experts(cfg).items() if k not in ("n_group", "topk_group")},
        head_dim=_head_dim(cfg),
        attention_bias=True,
        rope_parameters={**ROPE, "partial_rotary_factor": 0.5},
    )


def _gpt_oss(cfg, ids):
    """gpt-oss: alternating sliding-window and full attention with learnt sinks, YaRN, clamped-SwiGLU experts."""
    return transformers.GptOssConfig(
        **base_fields(cfg, ids),
        **_gqa(cfg),
        **_local_experts(cfg),
        sliding_window=8,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_layers)],
        rope_parameters={**YARN, "rope_theta": 150000.0, "truncate": False},
    )


def _minimax_m2(cfg, ids):
    return transformers.MiniMaxM2Config(
        **base_fields(cfg, ids),
        **_gqa(cfg),
        **_local_experts(cfg),
        rope_parameters={**ROPE, "partial_rotary_factor": 0.5},
    )


def _linear_attention(cfg: ModelConfig) -> dict:
    """Qwen3-Next / Qwen3.5 hybrid: Gated DeltaNet layers with full attention every 4th layer, partial rotary."""
    d = 2 * _head_dim(cfg)  # room for a rotary slice of 4 frequencies at a quarter of the head
    return {
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": d,
        "linear_key_head_dim": d,
        "linear_value_head_dim": d,
        "linear_num_key_heads": cfg.num_kv_heads,
        "linear_num_value_heads": cfg.num_heads,
        "layer_types": _every(cfg.num_layers, 4, "full_attention", "linear_attention"),
    }


def _shared_moe(cfg: ModelConfig) -> dict:
    return {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.moe_intermediate_size,
    }


def _qwen3_5_rope(cfg: ModelConfig) -> dict:
    """Interleaved multimodal RoPE over a quarter of the head: its frequencies split between time, height and width."""
    freqs = 2 * _head_dim(cfg) // 8
    return {
        **ROPE,
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [freqs - 2 * (freqs // 3), freqs // 3, freqs // 3],
        "mrope_interleaved": True,
    }


def _qwen3_next(cfg, ids):
    return transformers.Qwen3NextConfig(
        **base_fields(cfg, ids),
        **_linear_attention(cfg),
        **_shared_moe(cfg),
        intermediate_size=cfg.intermediate_size,
        rope_parameters={**ROPE, "partial_rotary_factor": 0.25},
    )


def _qwen3_5_text(cfg, ids):
    return transformers.Qwen3_5TextConfig(
        **base_fields(cfg, ids), **_linear_attention(cfg), intermediate_size=cfg.intermediate_size, rope_parameters=_qwen3_5_rope(cfg)
    )


def _qwen3_5_moe_text(cfg, ids):
    return transformers.Qwen3_5MoeTextConfig(**base_fields(cfg, ids), **_linear_attention(cfg), **_shared_moe(cfg), rope_parameters=_qwen3_5_rope(cfg))


def _nemotron_h(cfg, ids):
    """Nemotron-H / Nemotron 3: Mamba-2 layers, a few attention layers and MoE layers with a shared expert."""
    kinds = ["mamba", "moe", "attention"]
    return transformers.NemotronHConfig(
        **base_fields(cfg, ids),
        **_gqa(cfg),
        layers_block_type=[kinds[i % 3] for i in range(cfg.num_layers)],
        intermediate_size=cfg.intermediate_size,
        ssm_state_size=16,
        mamba_num_heads=cfg.num_heads,
        mamba_head_dim=_head_dim(cfg),
        n_groups=2,
        chunk_size=16,
        n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        moe_intermediate_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=cfg.moe_intermediate_size,
    )


def _llama4_text(cfg, ids):
    """Llama 4: MoE every other layer (top-1 routed + shared expert), chunked local attention, NoPE every 4th layer."""
    return transformers.Llama4TextConfig(
        **base_fields(cfg, ids),
        **_gqa(cfg),
        **{**_local_experts(cfg), "num_experts_per_tok": 1},
        intermediate_size_mlp=cfg.intermediate_size,
        interleave_moe_layer_step=2,
        attention_chunk_size=8,
        no_rope_layer_interval=4,
    )


def _glm5_next_text(cfg, ids):
    """GLM-5-next: KDA linear attention, then NoPE MLA + DSA layers in pairs whose second reuses the first's
    top-k selection (a shared indexer needs the layer right before it to select: a linear layer resets it),
    hyper-connections, a dense first layer."""
    layers = ["indexed_attention" if i % 4 >= 2 else "linear_attention" for i in range(cfg.num_layers)]
    return transformers.Glm5NextTextConfig(
        **base_fields(cfg, ids),
        **{**_mla(cfg), "qk_rope_head_dim": 0},
        **{**_experts(cfg), "n_group": 1},
        **{**_dsa(cfg), "index_kpool": 4},
        intermediate_size=cfg.intermediate_size,
        mlp_layer_types=["dense"] + ["sparse"] * (cfg.num_layers - 1),
        layer_types=layers,
        indexer_types=["shared" if i % 4 == 3 else "full" for i in range(cfg.num_layers)],
        linear_num_heads=cfg.num_heads,
        linear_head_dim=_head_dim(cfg),
        hc_mult=4,
    )


FAMILIES: dict[str, Family] = {
    "qwen2": Family(formats.CHATML, "Qwen2ForCausalLM", _legacy(transformers.Qwen2Config, tie=True)),
    "qwen3": Family(formats.CHATML, "Qwen3ForCausalLM", _legacy(transformers.Qwen3Config, tie=True)),
    "llama": Family(formats.CHATML, "LlamaForCausalLM", _legacy(transformers.LlamaConfig, tie=False)),
    "qwen3_moe": Family(
        formats.CHATML, "Qwen3MoeForCausalLM", _legacy(transformers.Qwen3MoeConfig, tie=False, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    ),
    "qwen3_5": Family(formats.QWEN3_5, "Qwen3_5ForConditionalGeneration", _qwen3_5_text, multimodal.qwen3_5),
    "qwen3_5_moe": Family(formats.QWEN3_5, "Qwen3_5MoeForConditionalGeneration", _qwen3_5_moe_text, multimodal.qwen3_5_moe),
    "qwen3_next": Family(formats.QWEN3_NEXT, "Qwen3NextForCausalLM", _qwen3_next),
    "deepseek_v3": Family(formats.DEEPSEEK_V3, "DeepseekV3ForCausalLM", _deepseek_v3),
    "deepseek_v32": Family(formats.DEEPSEEK_V3_1, "DeepseekV32ForCausalLM", _deepseek_v32),
    "deepseek_v4": Family(formats.DEEPSEEK_V3_1, "DeepseekV4ForCausalLM", _deepseek_v4),
    "kimi_k25": Family(formats.KIMI_K25, "Kimi_K25ForConditionalGeneration", _deepseek_v3, multimodal.kimi_k25),
    "glm4_moe": Family(formats.GLM4_5, "Glm4MoeForCausalLM", _glm4_moe),
    "glm_moe_dsa": Family(formats.GLM5, "GlmMoeDsaForCausalLM", _glm_moe_dsa),
    "glm5_next": Family(formats.GLM5, "Glm5NextForConditionalGeneration", _glm5_next_text, multimodal.glm5_next),
    "llama4": Family(formats.LLAMA4, "Llama4ForConditionalGeneration", _llama4_text, multimodal.llama4),
    "gpt_oss": Family(formats.HARMONY, "GptOssForCausalLM", _gpt_oss),
    "minimax_m2": Family(formats.MINIMAX_M2, "MiniMaxM2ForCausalLM", _minimax_m2),
    "nemotron_h": Family(formats.NEMOTRON_H, "NemotronHForCausalLM", _nemotron_h),
}

# Keys the published config.json carries that the transformers config class neither writes nor reads (its
# modelling code hard-codes them), which other readers of the checkpoint need: SGLang builds DeepSeek-style
# routing from them and, without MiniMax-M2's, serves that model without its QK norm and routing bias.
_DEEPSEEK_ROUTING = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
PUBLISHED_KEYS = dict.fromkeys(("deepseek_v3", "deepseek_v32", "kimi_k25", "glm_moe_dsa"), _DEEPSEEK_ROUTING)
PUBLISHED_KEYS["minimax_m2"] = {"scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True, "qk_norm_type": "per_layer"}


def published_keys(arch: str, text: transformers.PretrainedConfig) -> dict:
    """PUBLISHED_KEYS of `arch`, and Qwen3-Next's full_attention_interval (SGLang places its layers by it, not by layer_types)."""
    if arch == "qwen3_next":
        return {"full_attention_interval": text.layer_types.index("full_attention") + 1}
    return PUBLISHED_KEYS.get(arch, {})


# model types whose attention is not invariant to left padding (see the findings table)
EQUAL_LENGTH_BATCHES = frozenset({"deepseek_v4"})


def needs_equal_length_batches(config: transformers.PretrainedConfig) -> bool:
    """Whether a batch of this model must hold prompts of one length (no padding) to decode each row as alone."""
    return config.get_text_config(decoder=True).model_type in EQUAL_LENGTH_BATCHES


def hf_config(cfg: ModelConfig, ids: dict) -> transformers.PretrainedConfig:
    """The tiny checkpoint's config for `cfg.arch` (multimodal for a vision-language family)."""
    family = FAMILIES[cfg.arch]
    text = family.text_config(cfg, ids)
    text.update(published_keys(cfg.arch, text))
    return family.multimodal(text, cfg, ids) if family.multimodal else text
