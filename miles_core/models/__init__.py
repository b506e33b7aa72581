"""Models: loading any HF checkpoint; tiny builders of every supported family (tiny.py)."""

from __future__ import annotations

import transformers


def vocab_size(model_dir: str) -> int:
    """The model's vocabulary (its config's vocab_size: the embedding rows, which may be more than len(tokenizer))."""
    return transformers.AutoConfig.from_pretrained(model_dir).vocab_size
