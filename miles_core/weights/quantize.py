"""Low-precision rollout weights: a published policy's linear layers in FP8 (e4m3) or INT4, as SGLang loads them.

* "fp8": DeepSeek-V3's block quantization. Each 128 x 128 block of a weight [out, in] shares one fp32 scale,
  its absolute maximum over 448 (e4m3's largest value); the checkpoint holds the e4m3 `weight` and that scale
  as `weight_scale_inv` [ceil(out / 128), ceil(in / 128)] (the factor that restores the weight), and config.json
  `quantization_config` {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}.
* "mxfp8": OCP Microscaling. Each run of 32 inputs of a row shares a power-of-two scale 2^(floor(log2 amax) - 8)
  (8: e4m3's largest exponent), stored as its biased exponent (E8M0: uint8, 127 = 2^0) in `weight_scale_inv`
  [out, in / 32]; quant_method "mxfp8", weight_block_size [1, 32]. A value above 448 after scaling saturates.
* "int4-g32", "int4-g128": symmetric int4 per run of 32 or 128 inputs of a row, packed as compressed-tensors'
  W4A16 "pack-quantized" format (weights/int4.py): `<name>_packed`, `<name>_scale`, `<name>_shape` replace the weight.

Quantized: the 2-D projection weights of the decoder layers (attention q/k/v/o and the MLA projections, the MLP's and
each expert's gate/up/down). Embeddings, the output layer, norms and routers stay as published, as in DeepSeek's FP8
checkpoints. The trainer keeps its own precision (with train.qat its forward computes with the int4 numbers,
train/qat.py), and the train/rollout mismatch they add is measured each step (mismatch/*) and corrected by TIS/MIS
(algo.is_correction).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from miles_core.config.train import INT4_GROUP_SIZES
from miles_core.weights.int4 import compressed_tensors_config, dequantize_int4, pack_int4, quantize_int4, unpack_int4

FP8_MAX = 448.0  # e4m3's largest finite value
FP8_MAX_EXP = 8  # its exponent: 448 = 1.75 * 2^8
E8M0_BIAS = 127
BLOCK = 128  # fp8: 128 x 128 blocks
MX_BLOCK = 32  # mxfp8: 32 inputs of a row
INT4 = {f"int4-g{group}": group for group in INT4_GROUP_SIZES}  # format -> its group size
FORMATS = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]},
    "mxfp8": {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, MX_BLOCK]},
    **{fmt: compressed_tensors_config(group) for fmt, group in INT4.items()},
}
_PROJECTION = re.compile(r"(^|\.)layers\.\d+\..*proj(_with_mqa)?\.weight$")
SCALE_SUFFIX = "_scale_inv"


def quantizable(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and tensor.is_floating_point() and _PROJECTION.search(name) is not None and "visual" not in name


def _blocked(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """w [N, K] zero-padded to whole blocks, as [N / rows, rows, K / cols, cols]."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -k % cols, 0, -n % rows))
    return padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)


def _spread(scale: torch.Tensor, rows: int, cols: int, shape: torch.Size) -> torch.Tensor:
    """A per-block scale [N / rows, K / cols] as one factor per element of a weight of `shape`."""
    return scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: shape[0], : shape[1]]


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 weight_scale_inv [ceil(N/128), ceil(K/128)]) of a weight [N, K]."""
    blocks = _blocked(w, BLOCK, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w.float() / _spread(scale, BLOCK, BLOCK, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_mxfp8(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, uint8 E8M0 weight_scale_inv [N, K/32]) of a weight [N, K]; K must be a multiple of 32."""
    if w.shape[1] % MX_BLOCK:
        raise ValueError(f"{name}: mxfp8 scales runs of {MX_BLOCK} inputs, and its input size {w.shape[1]} is not a multiple")
    amax = w.float().abs().view(w.shape[0], -1, MX_BLOCK).amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - FP8_MAX_EXP, torch.full_like(amax, -E8M0_BIAS))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    q = (w.float() / _spread(torch.exp2(exponent), 1, MX_BLOCK, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, (exponent + E8M0_BIAS).to(torch.uint8)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if fmt in INT4:
        return dequantize_int4(unpack_int4(q), scale_inv, dtype)
    if fmt == "mxfp8":
        factor = _spread(torch.exp2(scale_inv.float() - E8M0_BIAS), 1, MX_BLOCK, q.shape)
    else:
        factor = _spread(scale_inv.float(), BLOCK, BLOCK, q.shape)
    return (q.float() * factor).to(dtype)


def quantize(w: torch.Tensor, fmt: str, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, weight_scale_inv) of a weight [N, K] in `fmt`; for int4, (packed int32 weight, scale)."""
    if fmt in INT4:
        q, scale = quantize_int4(w, INT4[fmt], name)
        return pack_int4(q), scale
    return quantize_mxfp8(w, name) if fmt == "mxfp8" else quantize_fp8(w)


def _suffixes(fmt: str) -> tuple[str, str]:
    """What a quantized weight's name and its scale's take on in `fmt`'s checkpoints."""
    return ("_packed", "_scale") if fmt in INT4 else ("", SCALE_SUFFIX)


def quantize_state(state: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """The state with each quantizable weight as its e4m3 tensor and `<name>_scale_inv` beside it; for int4 as
    `<name>_packed`, `<name>_scale` and `<name>_shape` (compressed-tensors' names)."""
    packed, scaled = _suffixes(fmt)
    out = {}
    for name, tensor in state.items():
        if quantizable(name, tensor):
            out[name + packed], out[name + scaled] = quantize(tensor, fmt, name)
            if fmt in INT4:
                out[name + "_shape"] = torch.tensor(tensor.shape)
        else:
            out[name] = tensor
    return out


def dequantize_state(state: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The state with every quantized weight (one with a scale beside it) restored to `dtype` under its own name,
    its scale (and int4's shape) dropped."""
    packed, scaled = _suffixes(fmt)
    weights = {n.removesuffix(scaled) for n in state if n.endswith(scaled) and n.removesuffix(scaled) + packed in state}
    dropped = {w + suffix for w in weights for suffix in (scaled, "_shape")}
    out = {}
    for name, t in state.items():
        weight = name.removesuffix(packed)
        if weight in weights and name == weight + packed:
            out[weight] = dequantize(t, state[weight + scaled], fmt, dtype)
        elif name not in dropped:
            out[name] = t
    return out


def fake_quantized(state: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """What an engine computes with after a quantized publish, in each weight's own dtype (an in-memory weight push)."""
    return {name: dequantize(*quantize(t, fmt, name), fmt, t.dtype) if quantizable(name, t) else t for name, t in state.items()}


def quantization_format(config: dict) -> str | None:
    """'fp8' / 'mxfp8' / 'int4-g<group>' for a checkpoint these functions quantized (config.json's
    quantization_config: for int4, exactly the configuration written here), else None."""
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") in ("fp8", "mxfp8"):
        return quantization["quant_method"]
    return next((fmt for fmt in INT4 if FORMATS[fmt] == quantization), None)


def quantize_dir(directory: str | Path, fmt: str) -> None:
    """Quantize an HF directory's weights in place (one model.safetensors) and record the format in its config.json."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{directory}: one model.safetensors expected to quantize, found {len(files)} weight files")
    save_file(quantize_state(load_file(str(files[0])), fmt), str(files[0]), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": FORMATS[fmt]}, indent=2))


def dequantized_copy(directory: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """An ordinary HF directory at `out` with a quantized directory's weights restored to `dtype` (what transformers
    loads on any device), its other files linked."""
    directory, out = Path(directory), Path(out)
    config = json.loads((directory / "config.json").read_text())
    fmt = quantization_format(config)
    out.mkdir(parents=True, exist_ok=True)
    for path in directory.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json" and path.is_file():
            (out / path.name).symlink_to(path.resolve())
    for path in directory.glob("*.safetensors"):
        save_file(dequantize_state(load_file(str(path)), fmt, dtype), str(out / path.name), metadata={"format": "pt"})
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
