"""The published shapes of the real-size recipes' models: the keys of each model's config.json that megatron splits
(what `miles_core.models.source.model_shape` reads; multimodal checkpoints keep them under text_config), copied from
the config.json on the model card whose address stands beside each. Keys a recipe's parallel sizes cannot break are
left out (an absent key reads as 0, which every size divides)."""

from __future__ import annotations

HF = "https://huggingface.co/{}/blob/main/config.json"


def _text(outer_type: str, **text) -> dict:
    """A multimodal checkpoint's config.json: the language model's keys under text_config."""
    return {"model_type": outer_type, "text_config": text}


def _qwen3_5_dense() -> dict:  # Qwen3.5-27B and Qwen3.6-27B share it
    return _text("qwen3_5", model_type="qwen3_5_text", num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, intermediate_size=17408)


def _llama4(experts: int) -> dict:
    return _text(
        "llama4",
        model_type="llama4_text",
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        intermediate_size=8192,
        num_local_experts=experts,
    )


def _gpt_oss(layers: int, experts: int) -> dict:
    return {
        "model_type": "gpt_oss",
        "num_hidden_layers": layers,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 2880,
        "num_local_experts": experts,
    }


# recipe name -> (where its config.json is published, the keys of it that matter here)
PUBLISHED = {
    "qwen3_4b_megatron_gpu": (
        HF.format("Qwen/Qwen3-4B-Instruct-2507"),
        {"model_type": "qwen3", "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 9728},
    ),
    "qwen3_5_27b": (HF.format("Qwen/Qwen3.5-27B"), _qwen3_5_dense()),
    "qwen3_6_27b": (HF.format("Qwen/Qwen3.6-27B"), _qwen3_5_dense()),
    "qwen3_6_35b_a3b": (
        HF.format("Qwen/Qwen3.6-35B-A3B"),
        _text("qwen3_5_moe", model_type="qwen3_5_moe_text", num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, num_experts=256),
    ),
    "qwen3_5_397b_a17b": (
        HF.format("Qwen/Qwen3.5-397B-A17B"),
        _text("qwen3_5_moe", model_type="qwen3_5_moe_text", num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2, num_experts=512),
    ),
    "deepseek_v4_flash": (
        HF.format("deepseek-ai/DeepSeek-V4-Flash"),
        {"model_type": "deepseek_v4", "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1, "n_routed_experts": 256},
    ),
    "deepseek_v3": (
        HF.format("deepseek-ai/DeepSeek-V3.1"),
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "intermediate_size": 18432,
            "n_routed_experts": 256,
        },
    ),
    "kimi_k2_5": (
        HF.format("moonshotai/Kimi-K2.5"),
        _text(
            "kimi_k25",
            model_type="deepseek_v3",
            num_hidden_layers=61,
            num_attention_heads=64,
            num_key_value_heads=64,
            intermediate_size=18432,
            n_routed_experts=384,
        ),
    ),
    "glm5": (
        HF.format("zai-org/GLM-5"),
        {
            "model_type": "glm_moe_dsa",
            "num_hidden_layers": 78,
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
            "intermediate_size": 12288,
            "n_routed_experts": 256,
        },
    ),
    "llama4_scout": (HF.format("meta-llama/Llama-4-Scout-17B-16E-Instruct"), _llama4(16)),
    "llama4_maverick": (HF.format("meta-llama/Llama-4-Maverick-17B-128E-Instruct"), _llama4(128)),
    "gpt_oss_20b": (HF.format("openai/gpt-oss-20b"), _gpt_oss(24, 32)),
    "gpt_oss_120b": (HF.format("openai/gpt-oss-120b"), _gpt_oss(36, 128)),
}
