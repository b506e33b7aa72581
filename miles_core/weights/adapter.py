"""LoRA adapters in PEFT's format (docs/lora.md): a directory of adapter_config.json and adapter_model.safetensors.

The keys are PEFT's: `base_model.model.<HF module path>.lora_A.weight` / `.lora_B.weight`, and
`base_model.model.<HF module path>.weight` for a module trained in full (train.lora.trainable, PEFT's modules_to_save).
A trainer checkpoint and a published policy hold an adapter so, never a copy of the base model it applies to.
adapter_config.json is PEFT's own LoraConfig, its target_modules the names of the modules actually adapted, so that
`peft.PeftModel.from_pretrained(base, dir)` and an SGLang server load the directory as it is.

peft is imported where adapters are used: its import costs seconds, which a run without LoRA does not pay.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from miles_core.config import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LORA_A = ".lora_A.weight"


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapted_modules(state: dict[str, torch.Tensor]) -> list[str]:
    """The names of the modules an adapter's state holds LoRA factors for (q_proj, ...), sorted."""
    return sorted({key.removesuffix(LORA_A).rsplit(".", 1)[-1] for key in state if key.endswith(LORA_A)})


def peft_config(lora: LoraConfig, target_modules: str | list[str] | None = None):
    """PEFT's LoraConfig of train.lora: its target modules, or `target_modules` (the concrete names of a trained adapter)."""
    import peft  # imported where adapters are used (its import costs seconds)

    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=target_modules or lora.targets,
        modules_to_save=lora.full or None,
        task_type="CAUSAL_LM",
    )


def with_adapters(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """The model with fresh LoRA adapters (B = 0: the same outputs), its base weights frozen; the model itself at rank 0."""
    if not lora.rank:
        return model
    import peft  # imported where adapters are used (its import costs seconds)

    return peft.get_peft_model(model, peft_config(lora))


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter (and the modules trained in full) of a PEFT model under PEFT's key names."""
    import peft  # imported where adapters are used (its import costs seconds)

    return {key: value.detach() for key, value in peft.get_peft_model_state_dict(model).items()}


def load_adapter_state(model: torch.nn.Module, adapter_dir: str | Path) -> None:
    """The adapter weights of `adapter_dir` into a PEFT model built with the same train.lora; every key must fit."""
    import peft  # imported where adapters are used (its import costs seconds)

    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    result = peft.set_peft_model_state_dict(model, load_file(path))
    if result.unexpected_keys:
        raise ValueError(f"{path}: keys the model has no adapter for: {sorted(result.unexpected_keys)[:5]}")


def write_adapter(out_dir: str | Path, state: dict[str, torch.Tensor], lora: LoraConfig, dtype: torch.dtype) -> None:
    """`state` (PEFT key names) as an adapter directory in `dtype`, with PEFT's adapter_config.json for train.lora."""
    if not any(key.endswith(LORA_A) for key in state):
        raise ValueError(f"{out_dir}: the adapter state holds no {LORA_A} factor (train.lora.rank is {lora.rank})")
    save_file({key: value.to(dtype).clone().contiguous() for key, value in state.items()}, str(Path(out_dir) / ADAPTER_WEIGHTS))
    config = peft_config(lora, adapted_modules(state))
    config.inference_mode = True
    config.save_pretrained(str(out_dir))
