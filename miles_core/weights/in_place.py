"""A checkpoint's weights copied into a model built already, where the model is what that checkpoint would build.

Building a transformers model costs far more than copying its weights for a small one (the main recipe's 3M-parameter
policy: ~50 ms to build and load against ~3 ms to copy in, this repository's CPU), so where one process loads one
architecture again and again (the embedded rollout engine per policy version, the train stage per iteration of a local
run) it builds once and copies in after. `built_from(model_dir)` is what decides whether a directory would build the
same model: the bytes of its config files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from miles_core.weights.check import CheckpointError, weight_files


def built_from(model_dir: str | Path) -> tuple[bytes | None, ...]:
    """The bytes of what a model is built from (config.json, generation_config.json), None for a missing one."""
    return tuple(path.read_bytes() if path.is_file() else None for path in (Path(model_dir) / "config.json", Path(model_dir) / "generation_config.json"))


def load_in_place(model: torch.nn.Module, model_dir: str | Path) -> bool:
    """The weights of `model_dir` copied into `model`, where its safetensors hold exactly the model's tensors (a tied
    head's once), each floating-point and of the model's shape; False, nothing changed, where they do not or a file does
    not read (a full load then judges the directory and names what is wrong). The caller has made sure `model` was built
    from the same config files (`built_from`)."""
    try:
        state = {name: tensor for file in weight_files(Path(model_dir)) for name, tensor in load_file(file).items()}
    except (CheckpointError, SafetensorError, OSError):
        return False
    own = model.state_dict()
    loaded = {own[name].data_ptr() for name in state if name in own}
    tied = all(own[name].data_ptr() in loaded for name in own.keys() - state.keys())  # shares a tensor loaded
    if not (tied and state.keys() <= own.keys() and all(t.shape == own[k].shape and t.is_floating_point() for k, t in state.items())):
        return False
    model.load_state_dict(state, strict=False)
    return True
