"""Models: loading any HF checkpoint as a causal LM (loading.py); tiny builders of every supported family
(tiny.py, families.py, chat_formats.py). The package itself reads configs only: importing it, or a module of it that
needs no model class, does not load transformers' modeling code (seconds of every task's start-up)."""

from __future__ import annotations

import transformers


def text_config(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """The config of the model's text decoder (the config itself for a text-only model)."""
    return config.get_text_config(decoder=True)


def is_multimodal(config: transformers.PretrainedConfig) -> bool:
    return text_config(config) is not config


def vocab_size(model_dir: str) -> int:
    """The model's vocabulary (its text config's vocab_size: the embedding rows, which may be more than len(tokenizer))."""
    return text_config(transformers.AutoConfig.from_pretrained(model_dir)).vocab_size
