"""The vision-language families' checkpoint configs: a text config wrapped with a one-block vision tower.

Each wrapper takes the family's tiny text config (miles_core/models/families.py), the ModelConfig and
the tokenizer's ids, and returns the multimodal config of the class a user's checkpoint holds
(`Qwen3_5ForConditionalGeneration`, `Llama4ForConditionalGeneration`, `Kimi_K25ForConditionalGeneration`,
`Glm5NextForConditionalGeneration`), its image/video placeholder ids pointing at the tokenizer's
vision special tokens.  The tower is tiny (one block of width 32) but complete, so the checkpoint
holds every tensor of the published layout.
"""

from __future__ import annotations

import transformers

VISION_WIDTH = 32  # every tiny vision tower: one block of this width


def _wrap(config_class: type, text: transformers.PretrainedConfig, vision: dict, **token_ids) -> transformers.PretrainedConfig:
    return config_class(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False, **token_ids)


def qwen3_5(text, cfg, ids, config_class=transformers.Qwen3_5Config):
    vision = {"depth": 1, "hidden_size": VISION_WIDTH, "intermediate_size": 2 * VISION_WIDTH, "num_heads": 2, "out_hidden_size": cfg.hidden_size}
    return _wrap(
        config_class,
        text,
        {**vision, "num_position_embeddings": 64},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def qwen3_5_moe(text, cfg, ids):
    return qwen3_5(text, cfg, ids, transformers.Qwen3_5MoeConfig)


def llama4(text, cfg, ids):
    vision = {"hidden_size": VISION_WIDTH, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 2 * VISION_WIDTH}
    projector = {"vision_output_dim": VISION_WIDTH, "projector_input_dim": cfg.hidden_size, "projector_output_dim": cfg.hidden_size}
    return _wrap(
        transformers.Llama4Config,
        text,
        {**vision, **projector, "image_size": 28, "patch_size": 14},
        boi_token_index=ids["<|image_start|>"],
        eoi_token_index=ids["<|image_end|>"],
        image_token_index=ids["<|patch|>"],
    )


def kimi_k25(text, cfg, ids):
    """Kimi-K2.5: a MoonViT-style tower in front of a DeepSeek-V3 text model."""
    vision = {"num_hidden_layers": 1, "hidden_size": VISION_WIDTH, "intermediate_size": 2 * VISION_WIDTH, "num_attention_heads": 2, "patch_size": 4}
    return _wrap(
        transformers.Kimi_K25Config,
        text,
        {**vision, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 2},
        projection_hidden_size=VISION_WIDTH,
        image_token_id=ids["<|media_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|media_start|>"],
        vision_end_token_id=ids["<|media_end|>"],
    )


def glm5_next(text, cfg, ids):
    vision = {"depth": 1, "hidden_size": VISION_WIDTH, "num_heads": 2, "intermediate_size": 2 * VISION_WIDTH, "projection_intermediate_size": 2 * VISION_WIDTH}
    media = {
        f"{kind}_{edge}_token_id": ids[f"<|{edge_name}_of_{kind}|>"] for kind in ("image", "video") for edge, edge_name in (("start", "begin"), ("end", "end"))
    }
    return _wrap(
        transformers.Glm5NextConfig,
        text,
        {**vision, "image_size": 28, "patch_size": 14, "out_hidden_size": cfg.hidden_size},
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        **media,
    )
