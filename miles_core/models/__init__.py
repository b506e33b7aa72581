"""Models: loading any HF checkpoint as a causal LM (loading.py); tiny builders of every supported family
(tiny.py, families.py, chat_formats.py). The package itself reads configs and calls models only: importing it loads
neither torch nor transformers (seconds of every task's start-up; transformers is imported where a config is read), and
a module of it that needs no model class does not load transformers' modeling code."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import TYPE_CHECKING

from miles_core.recent import Recent

if TYPE_CHECKING:
    import torch
    import transformers


def text_config(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """The config of the model's text decoder (the config itself for a text-only model)."""
    return config.get_text_config(decoder=True)


def is_multimodal(config: transformers.PretrainedConfig) -> bool:
    return text_config(config) is not config


def vocab_size(model_dir: str) -> int:
    """The model's vocabulary (its text config's vocab_size: the embedding rows, which may be more than len(tokenizer)),
    read once per process for the same config.json (every policy and checkpoint of a run carries the same)."""
    import transformers  # where a config is read (the package docstring)

    config = Path(model_dir, "config.json").read_bytes()
    return _vocabularies.kept(config, lambda: text_config(transformers.AutoConfig.from_pretrained(model_dir)).vocab_size)


_vocabularies = Recent(16)  # config.json's bytes -> its vocabulary


def with_cache(model: torch.nn.Module, cache) -> dict:
    """The keyword argument that hands a KV cache to `model`'s forward: `cache`, transformers 5's name for it (the old
    `past_key_values` warns on every call), where the forward (under a PEFT wrapper, its base model's) takes it."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {_cache_keyword(type(base)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"
