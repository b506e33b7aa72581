"""Models: loading any HF checkpoint as a causal LM (loading.py); tiny builders of every supported family
(tiny.py, families.py, chat_formats.py)."""

from __future__ import annotations

import transformers

from miles_core.models.loading import load_causal_lm, text_config

__all__ = ["load_causal_lm", "vocab_size"]


def vocab_size(model_dir: str) -> int:
    """The model's vocabulary (its text config's vocab_size: the embedding rows, which may be more than len(tokenizer))."""
    return text_config(transformers.AutoConfig.from_pretrained(model_dir)).vocab_size
