"""INT4 weights: symmetric per-group int4 quantization along a weight's input dimension, packed as compressed-tensors'
"pack-quantized" W4A16 format, which SGLang loads (CompressedTensorsWNA16, Marlin kernels).

Each run of `group_size` (32 or 128) inputs of a row shares one scale, the run's absolute maximum over 7, so that
q = round(w / scale) lies in [-7, 7]: the grid is symmetric about 0 (a weight and its negation quantize alike, and
both ends of the run are exact), where max / 8 would reach -8 for the negative end only. A 4-bit integer's -8 is
never written: a scale rounded to a bf16 weight's dtype (relative error at most 2^-9) keeps |w| / scale below 7.5;
the clamp to [-8, 7] only guards the 4 bits. A weight [out, in] is stored as three tensors beside its name:

* weight_packed: int32 [out, in / 8]. Element k of a row is the nibble q + 8 (unsigned, 0..15) at bits 4 (k % 8) ..
  4 (k % 8) + 3 of word k // 8 (compressed_tensors' pack_to_int32: little-endian nibbles, SGLang's uint4b8 type).
* weight_scale: [out, in / group_size] in the weight's dtype (the scale is rounded to it before quantizing).
* weight_shape: int64 [out, in].
"""

from __future__ import annotations

import torch

INT4_MAX = 7  # the largest magnitude of the symmetric grid [-7, 7]
INT4_MIN = -8  # what 4 bits hold below it
PER_WORD = 8  # nibbles in an int32
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


def compressed_tensors_config(group_size: int) -> dict:
    """config.json's quantization_config for int4 weights in groups of `group_size` (compressed-tensors W4A16): every
    linear layer SGLang builds is quantized but the output layer, routers and a vision tower, which stay as published."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size, "dynamic": False, "actorder": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None}},
        "ignore": ["lm_head", "re:.*mlp[.]gate$", "re:.*visual.*"],
    }


def quantize_int4(w: torch.Tensor, group_size: int, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 q in [-8, 7] of w's shape, scale [..., in / group_size] in w's dtype) of a weight [..., in]."""
    if w.shape[-1] % group_size:
        raise ValueError(f"{name}: int4 scales runs of {group_size} inputs, and its input size {w.shape[-1]} is not a multiple")
    groups = w.float().unflatten(-1, (-1, group_size))
    scale = (groups.abs().amax(-1) / INT4_MAX).to(w.dtype)
    divisor = scale.float().clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)  # an all-zero group stays 0
    q = torch.round(groups / divisor).clamp(INT4_MIN, INT4_MAX).to(torch.int8)
    return q.flatten(-2), scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale, each scale over its run of in / scale.shape[-1] inputs, in `dtype`."""
    return (q.float().unflatten(-1, (scale.shape[-1], -1)) * scale.float().unsqueeze(-1)).flatten(-2).to(dtype)


def fake_quantize_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """What the weight is after quantizing and restoring, in its own dtype."""
    return dequantize_int4(*quantize_int4(w, group_size), w.dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] in [-8, 7] -> int32 [out, in / 8], eight biased nibbles (q + 8) a word, the first lowest."""
    nibbles = (q.long() + 8).unflatten(-1, (-1, PER_WORD))
    words = (nibbles << _SHIFTS).sum(-1)  # 0 .. 2^32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, as int32


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [out, in / 8] -> int8 [out, in], the inverse of pack_int4."""
    return (((packed.long().unsqueeze(-1) >> _SHIFTS) & 0xF) - 8).flatten(-2).to(torch.int8)
