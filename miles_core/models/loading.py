"""A causal LM from any HF directory: a text checkpoint as it is, a vision-language one as its text model.

`load_causal_lm(model_dir, dtype)` is how the torch engine and the torch trainer load a policy.  For a
multimodal checkpoint (a config with a text sub-config: Qwen3.5, Llama 4, Kimi-K2.5, ...) transformers
loads the whole model with its own class, so every weight renaming its checkpoints need is applied
once, in one place; then the text causal LM of the text config is assembled around that model's
language model and output layer (the same tensors, nothing copied) and the vision tower is dropped.
The policy then trains, rolls out and is published as a text model (`save_pretrained` writes the text
config), loadable by `AutoModelForCausalLM.from_pretrained`.  A family without a text causal LM class
in transformers (GLM-5-next) keeps its multimodal class, which runs on text alone; its parameters
outside the language model are frozen.

`expected_tensors(config)` names every tensor that loading reads, as `save_pretrained` writes them
(transformers 5 saves the published layout: per-expert tensors, original prefixes), for the boundary
check of a weight directory (miles_core/weights/check.py).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig, PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion  # what save_pretrained applies (transformers 5)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from miles_core.models import is_multimodal, text_config
from miles_core.weights.quantize import dequantized_copy, quantization_format


def text_causal_lm_class(config: PretrainedConfig) -> type | None:
    """The causal LM class of a multimodal config's text config, None where transformers has none."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text_config(config).model_type)
    return getattr(transformers, name, None) if name else None


def _module_name(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def language_prefixes(model: PreTrainedModel) -> tuple[str, str]:
    """The module names of a multimodal model's language model and output layer (e.g. `model.language_model`, `lm_head`)."""
    return _module_name(model, model.get_decoder()) + ".", _module_name(model, model.get_output_embeddings()) + "."


def _text_model(full: PreTrainedModel, causal_lm: type) -> PreTrainedModel:
    """The text causal LM around `full`'s language model and output layer (shared tensors)."""
    decoder, head = full.get_decoder(), full.get_output_embeddings()
    if isinstance(decoder, causal_lm):  # Llama 4 holds a whole causal LM as its language model
        lm = decoder
    else:
        config = text_config(full.config)
        config.tie_word_embeddings = head.weight is decoder.get_input_embeddings().weight
        with torch.device("meta"):  # a shell: its modules are replaced by the loaded ones below
            lm = causal_lm(config)
        setattr(lm, lm.base_model_prefix, decoder)
        lm.set_output_embeddings(head)
    left = [name for name, t in [*lm.named_parameters(), *lm.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{type(lm).__name__} has parts that {type(full).__name__} does not provide: {left[:3]}")
    lm.generation_config = full.generation_config
    return lm


def _freeze_outside_language(model: PreTrainedModel) -> PreTrainedModel:
    prefixes = language_prefixes(model)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(prefixes))
    return model


def load_causal_lm(model_dir: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The causal LM of an HF directory: text checkpoints as they are, multimodal ones as their text model, weights
    quantized at publish (weights/quantize.py) restored to `dtype` first (what the engine then computes with)."""
    if quantization_format(json.loads((Path(model_dir) / "config.json").read_text())):
        with tempfile.TemporaryDirectory(prefix="dequantized-") as plain:
            return load_causal_lm(str(dequantized_copy(model_dir, plain, dtype)), dtype)
    config = AutoConfig.from_pretrained(model_dir)
    if not is_multimodal(config):
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    full = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype)
    causal_lm = text_causal_lm_class(config)
    return _text_model(full, causal_lm) if causal_lm is not None else _freeze_outside_language(full)


def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The model `load_causal_lm` loads a checkpoint of this config into (a multimodal one's whole model), built on the
    meta device: its modules and shapes without memory."""
    with torch.device("meta"):
        return (AutoModelForImageTextToText if is_multimodal(config) else AutoModelForCausalLM).from_config(config)


def expected_tensors(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """name -> shape of every parameter `load_causal_lm` reads from a checkpoint with this config, named as
    `save_pretrained` writes them.  Built on the meta device (no memory); tied weights appear once."""
    model = meta_model(config)
    params = dict(model.named_parameters())
    if is_multimodal(config) and text_causal_lm_class(config) is not None:  # the vision tower is not read
        prefixes = language_prefixes(model)
        params = {name: p for name, p in params.items() if name.startswith(prefixes)}
    return {name: tuple(t.shape) for name, t in revert_weight_conversion(model, params).items()}
