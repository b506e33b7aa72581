"""LoRA on the megatron backend, its naming side (no megatron import): which megatron linears a recipe's target modules
adapt, what the backend refuses, and the adapter under PEFT's names.

Recipes name HF modules (q_proj, ..., down_proj), as PEFT does on the torch backend.  megatron fuses some of them:
`linear_qkv` is q_proj, k_proj and v_proj (grouped per KV head), `linear_fc1` is gate_proj and up_proj ([gate; up]).
A fused linear carries one adapter: one A [r, in] and one B whose rows are laid out as the fused weight's.  Exported
for PEFT, each projection of the group gets that same A and its own rows of B (split as the conversion splits the
fused weight, hf_megatron.links), so each projection's update B_part @ A is exactly its rows of the fused update.
A target set must therefore hold whole groups ({q_proj, k_proj, v_proj}, {gate_proj, up_proj}).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config's rules read this module: it imports neither torch nor the converter until an adapter is converted
    import torch

    from miles_core.checkpoint.hf_megatron import ArchSpec

# a layer's megatron linear -> the HF projections it computes (paths under model.layers.<i>.)
LINEARS = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
}
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")  # the adapter parameters of an adapted linear, beside its frozen weight
PEFT_PREFIX = "base_model.model."
MOE_REASON = (
    "the megatron backend adapts dense GQA layers only (attention and dense MLP projections); MoE experts, routers and "
    "multi-latent attention get no adapters there: use train.backend: torch, or rank: 0"
)
TRAINABLE_REASON = "the megatron backend trains the adapters only (every other weight frozen): use '' or train.backend: torch"
DROPOUT_REASON = (
    "at tensor_parallel > 1 the megatron backend's adapters take no dropout (the ranks of a row-parallel adapter would "
    "each draw a mask for their own part of the input from one seed): use 0.0, or tensor_parallel: 1"
)


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def _targeted(lora, path: str) -> bool:
    """PEFT's matching: all-linear, a name the path ends with (after a dot), or a regex matching the whole path."""
    targets = lora.targets
    if targets == "all-linear":
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, path) is not None
    return any(path == name or path.endswith("." + name) for name in targets)


def _layer_paths(layer: int) -> dict[str, list[str]]:
    return {linear: [f"model.layers.{layer}.{p}" for p in projections] for linear, projections in LINEARS.items()}


def target_refusal(lora, num_layers: int) -> str | None:
    """Why train.lora.target_modules cannot be trained on the megatron backend, if it cannot."""
    paths = [path for layer in range(num_layers) for group in _layer_paths(layer).values() for path in group]
    if isinstance(lora.targets, list):
        unknown = [name for name in lora.targets if not any(path == name or path.endswith("." + name) for path in paths)]
        if unknown:
            known = ", ".join(p.rsplit(".", 1)[1] for group in LINEARS.values() for p in group)
            return f"{', '.join(unknown)}: not a projection the megatron backend adapts ({known})"
    chosen = []
    for layer in range(num_layers):
        picked = {linear: [_targeted(lora, p) for p in group] for linear, group in _layer_paths(layer).items()}
        partial = [linear for linear, hits in picked.items() if any(hits) and not all(hits)]
        if partial:
            names = [p.rsplit(".", 1)[1] for p in LINEARS[partial[0]]]
            return f"{', '.join(names[:-1])} and {names[-1]} are one fused linear on the megatron backend, with one adapter: target all of them or none"
        chosen.append(tuple(linear for linear, hits in picked.items() if all(hits)))
    if len(set(chosen)) > 1:
        return "must adapt the same projections in every layer on the megatron backend (its checkpoint stacks each projection's tensors over the layers)"
    if not chosen or not chosen[0]:
        return "adapts no projection of the model"
    return None


def adapted_linears(lora) -> tuple[str, ...]:
    """The linears (LINEARS' keys) adapted in every layer, once target_refusal has passed."""
    return tuple(linear for linear, group in _layer_paths(0).items() if all(_targeted(lora, p) for p in group))


def megatron_refusal(lora, spec: ArchSpec, tensor_parallel: int) -> tuple[str, str] | None:
    """(key, reason) when the megatron backend cannot train these adapters on this model, else None."""
    if spec.num_experts or spec.mla:
        return "train.lora.rank", MOE_REASON
    if lora.full:
        return "train.lora.trainable", TRAINABLE_REASON
    if lora.dropout and tensor_parallel > 1:
        return "train.lora.dropout", DROPOUT_REASON
    reason = target_refusal(lora, spec.num_layers)
    return ("train.lora.target_modules", reason) if reason else None


def peft_adapter(spec: ArchSpec, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unsharded megatron adapters ({<linear>.lora_A / .lora_B}) -> PEFT's state dict: per HF projection, lora_A [r, in]
    (a fused linear's A, shared) and lora_B [out, r] (its rows of the fused B)."""
    from miles_core.checkpoint.hf_megatron import links  # the converter (torch): imported where an adapter is converted

    out = {}
    for link in links(spec):
        linear = link.mg.removesuffix(".weight")
        if f"{linear}.lora_A" not in full:  # not adapted (or a bias)
            continue
        for hf_name, b in zip(link.hf, link.split(full[f"{linear}.lora_B"])):
            module = PEFT_PREFIX + hf_name.removesuffix(".weight")
            out[f"{module}.lora_A.weight"] = full[f"{linear}.lora_A"].clone()  # each projection its own copy of the shared A
            out[f"{module}.lora_B.weight"] = b.contiguous()
    return out


def merged(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """An unsharded megatron state with each adapted weight W + scale * B @ A (what the adapted model computes)."""
    out = dict(base)
    for name, a in adapters.items():
        if name.endswith(".lora_A"):
            linear = name.removesuffix(".lora_A")
            weight = base[f"{linear}.weight"]
            out[f"{linear}.weight"] = (weight.float() + scale * adapters[f"{linear}.lora_B"].float() @ a.float()).to(weight.dtype)
    return out
