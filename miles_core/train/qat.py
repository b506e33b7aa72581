"""Quantization-aware training (train.qat: int4): the trainer's forward computes with the int4 weights a published
policy's engines compute with, and the gradient reaches the fp32 master weights unchanged (straight-through).

The weights are those `publish.quantization: int4` quantizes (weights/quantize.py `quantizable`), found in the model
as it is in memory: a 2-D projection weight, or a fused 3-D expert tensor (transformers 5 holds a MoE layer's
experts as one [experts, out, in] tensor and saves each expert's projection apart) whose saved projections are runs of
its rows with the input dimension kept last, so that its groups along that dimension are those of the published
weights. Other stacked experts (gpt-oss keeps `x @ W` stacks on disk too) are published unquantized and trained so.

Around each forward of a module holding such weights, a forward pre-hook puts dequant(quant(w)) in the weight's
place (as `torch.func.functional_call` swaps parameters) and a forward hook puts the parameter back: the state dict,
the optimizer and the checkpoints see the parameters alone, and a module run again (activation recomputation) is
fake-quantized again.
"""

from __future__ import annotations

import functools

import torch
from transformers.core_model_loading import revert_weight_conversion  # what save_pretrained applies (transformers 5)

from miles_core.weights.int4 import fake_quantize_int4
from miles_core.weights.quantize import quantizable


class StraightThrough(torch.autograd.Function):
    """Forward: the int4 fake-quantized weight; backward: the gradient w.r.t. it, passed to the weight as it is."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group_size: int) -> torch.Tensor:
        return fake_quantize_int4(weight, group_size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _published_quantized(model: torch.nn.Module, name: str, param: torch.Tensor) -> bool:
    """Whether `param` is saved as quantizable projections only, each made of its rows whole (every element keeps its
    input index: the input dimension stays last and is neither split nor moved)."""
    if param.dim() not in (2, 3):
        return False
    columns = torch.arange(param.shape[-1], dtype=torch.float32)  # each element: its input index
    saved = revert_weight_conversion(model, {name: columns.expand(param.shape)})
    return all(quantizable(key, t) and t.shape[-1] == columns.numel() and bool((t == columns).all()) for key, t in saved.items())


def qat_weights(model: torch.nn.Module) -> list[str]:
    """The names of the parameters the published int4 policy holds quantized."""
    return [name for name, param in model.named_parameters() if _published_quantized(model, name, param)]


def _fake_quantize(names: list[str], group_size: int, originals: dict, module: torch.nn.Module, args) -> None:
    for name in names:
        originals[name] = module._parameters[name]
        module._parameters[name] = StraightThrough.apply(originals[name], group_size)


def _restore(originals: dict, module: torch.nn.Module, args, output) -> None:
    for name, param in originals.items():
        module._parameters[name] = param
    originals.clear()


def fake_quantize_forward(model: torch.nn.Module, group_size: int) -> None:
    """Make `model`'s forward compute with its published-quantized weights fake-quantized to int4 in groups of
    `group_size` inputs. A weight whose input size the groups do not divide is refused by name."""
    by_module: dict[str, list[str]] = {}
    for name in qat_weights(model):
        module_name, _, param_name = name.rpartition(".")
        if model.get_parameter(name).shape[-1] % group_size:
            raise ValueError(f"train.qat_group_size: {name} has {model.get_parameter(name).shape[-1]} inputs, not a multiple of {group_size}")
        by_module.setdefault(module_name, []).append(param_name)
    for module_name, param_names in by_module.items():
        module, originals = model.get_submodule(module_name), {}
        module.register_forward_pre_hook(functools.partial(_fake_quantize, param_names, group_size, originals))
        module.register_forward_hook(functools.partial(_restore, originals), always_call=True)
