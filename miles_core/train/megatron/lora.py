"""LoRA adapters on megatron-core's linear layers (megatron-core 0.16.1 has none of its own; docs/lora.md, "Megatron").

An adapted linear computes base(x) + scale * B(A(dropout(x))), scale = alpha / rank, with A kaiming-uniform and B
zero at the start (PEFT's defaults) and every other weight of the model frozen (requires_grad False), so megatron's
DDP buckets and the distributed optimizer hold the adapters only.  Which linears are adapted, and the adapter under
PEFT's names, is checkpoint/lora_map.py's business.  Under tensor parallelism each adapter is split as its base layer:
* column-parallel (linear_qkv, linear_fc1): A whole on every rank, applied to the whole sequence (gathered under
  sequence parallel as the base layer gathers it); A's output all-reduced in the backward pass so that A's gradient
  sums every rank's rows of B; B split along the output as the base weight (linear_fc1's [gate; up] halves each split).
* row-parallel (linear_proj, linear_fc2): A split along the input as the base weight, its partial products summed over
  the ranks (reduce-scattered to each rank's part of the sequence under sequence parallel); B whole on every rank, its
  gradient (from the rank's part of the sequence) summed over the ranks by finalize_model_grads (`sequence_parallel`).
Each adapter starts from the same full tensors at any parallel sizes (seeded by its name), so TP 2 trains as TP 1.
Imported only by the megatron backend (arch_config, trainer), where adapters are built.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import replace

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import mappings  # the optional backend's own modules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, set_tensor_model_parallel_attributes
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from miles_core.checkpoint import lora_map, torch_dist


class _Adapted:
    """What both adapted linears share: the adapter's parameters, its dropout and scale, its checkpoint tensors."""

    def _add_adapter(self, lora, a_shape: tuple[int, int], b_shape: tuple[int, int], dtype: torch.dtype) -> None:
        self.lora_A = torch.nn.Parameter(torch.zeros(a_shape, dtype=dtype))  # [r, in (this rank's part)]
        self.lora_B = torch.nn.Parameter(torch.zeros(b_shape, dtype=dtype))  # [out (this rank's part), r]
        self.lora_dropout = torch.nn.Dropout(lora.dropout)
        self.lora_scale = lora.alpha / lora.rank

    def _sharded(self, prefix, sharded_offsets, metadata, axes: dict[str, int]):
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]
        )


class LoraColumnParallelLinear(_Adapted, ColumnParallelLinear):
    def __init__(self, input_size, output_size, *, lora, gated: bool = False, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        self.gated = gated  # linear_fc1: [gate; up] rows, each half split over the ranks
        self._add_adapter(lora, (lora.rank, input_size), (self.output_size_per_partition, lora.rank), kwargs["config"].params_dtype)
        set_tensor_model_parallel_attributes(self.lora_B, True, 0, 1)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        output, bias = super().forward(input_, weight, runtime_gather_output)
        x = input_  # [s, b, in], or this rank's part of the sequence under sequence parallel
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.tp_group)
        hidden = mappings.copy_to_tensor_model_parallel_region(F.linear(self.lora_dropout(x), self.lora_A), group=self.tp_group)  # [s, b, r]
        return output + self.lora_scale * F.linear(hidden, self.lora_B), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sharded = self._sharded(prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0, "lora_B": 0})
        if self.gated:  # the MLP gives the weight megatron's [gate; up] sharding, the adapter's B gets it here
            key = f"{prefix}lora_B"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
        return sharded


class LoraRowParallelLinear(_Adapted, RowParallelLinear):
    def __init__(self, input_size, output_size, *, lora, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        self._add_adapter(lora, (lora.rank, self.input_size_per_partition), (output_size, lora.rank), kwargs["config"].params_dtype)
        set_tensor_model_parallel_attributes(self.lora_A, True, 1, 1)
        self.lora_B.sequence_parallel = self.sequence_parallel

    def forward(self, input_):
        output, bias = super().forward(input_)
        partial = F.linear(self.lora_dropout(input_), self.lora_A)  # [s, b, r]: this rank's inputs' share
        if self.sequence_parallel:
            hidden = mappings.reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
        else:
            hidden = mappings.reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
        return output + self.lora_scale * F.linear(hidden, self.lora_B), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self._sharded(prefix, sharded_offsets, metadata, {"weight": 1, "lora_A": 1})


def _adapted_part(part, name: str, lora):
    """A layer spec's self_attention or mlp with its adapted linears (those of lora_map.adapted_linears named `name`.*)."""
    adapted = [linear.split(".")[1] for linear in lora_map.adapted_linears(lora) if linear.startswith(name + ".")]
    if not adapted:
        return part
    column = {linear: ModuleSpec(LoraColumnParallelLinear, params={"lora": lora, "gated": linear == "linear_fc1"}) for linear in ("linear_qkv", "linear_fc1")}
    row = {linear: ModuleSpec(LoraRowParallelLinear, params={"lora": lora}) for linear in ("linear_proj", "linear_fc2")}
    return replace(part, submodules=replace(part.submodules, **{linear: (column | row)[linear] for linear in adapted}))


def with_adapters(layer, lora):
    """A dense layer spec whose targeted linears (train.lora.target_modules) carry adapters."""
    attention = _adapted_part(layer.submodules.self_attention, "self_attention", lora)
    mlp = _adapted_part(layer.submodules.mlp, "mlp", lora)
    return replace(layer, submodules=replace(layer.submodules, self_attention=attention, mlp=mlp))


def freeze_base(model) -> None:
    """Only the adapters train: every other parameter leaves the gradient buffers and the optimizer."""
    for name, param in model.named_parameters():
        param.requires_grad = lora_map.is_adapter(name)


def _fresh(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    if name.endswith(".lora_B"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
    return torch.nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=generator)  # PEFT's lora_A


def init_adapters(model, spec, seed: int) -> None:
    """A kaiming-uniform and B zero, from full tensors seeded by each adapter's name: the same at any parallel sizes."""
    shapes = torch_dist.full_shapes(model, adapters=True)
    torch_dist.load_full_state(model, spec, {name: _fresh(name, shape, seed) for name, shape in shapes.items()}, adapters=True)
