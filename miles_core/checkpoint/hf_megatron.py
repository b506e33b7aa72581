"""HF <-> megatron-core GPTModel weight mapping for Qwen2, Qwen3, Llama (dense) and Qwen3-MoE.

Pure tensor code (no megatron import): an HF state dict as stored in `model.safetensors` maps to
the state dict of an unsharded (TP=PP=EP=1) GPTModel built with the local layer spec, and back.
Sharding is megatron's business: `miles_core.checkpoint.torch_dist` saves this state with
`dist_checkpointing`, which reshards it to any TP/PP/EP on load.

What the mapping does, per layer:
* q/k/v projections (GQA) fuse into `linear_qkv`, grouped per KV head: for each of the
  num_kv_heads groups, that group's query heads, then its key head, then its value head; biases
  (Qwen2) the same way.
* gate/up projections (SwiGLU) fuse into `linear_fc1` as [gate; up]; experts likewise.
* q/k norms (Qwen3) map to `q_layernorm` / `k_layernorm`.
* The vocabulary is padded with zero rows to a multiple of VOCAB_PAD_MULTIPLE, independent of the
  TP size so one checkpoint loads at any TP; the padding is cut on the way back.
* Tied embeddings (Qwen2/Qwen3 tiny models) have no `output_layer`; untied ones (Llama,
  Qwen3-MoE) map `lm_head` to it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_PAD_MULTIPLE = 128  # megatron's make_vocab_size_divisible_by default; divisible by any TP <= 128
ARCHS = ("qwen2", "qwen3", "llama", "qwen3_moe")


@dataclass(frozen=True)
class ArchSpec:
    """What the mapping and the megatron model builder need from an HF config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    rope_theta: float
    max_positions: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    moe_renormalize: bool = False  # Qwen3-MoE norm_topk_prob: top-k weights sum to 1

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE


def arch_spec(hf_config: dict, source: str = "config.json") -> ArchSpec:
    """The ArchSpec of an HF config (a dict as in config.json); unsupported models fail here."""
    kind = hf_config.get("model_type")
    if kind not in ARCHS:
        raise ValueError(f"{source}: model_type {kind!r} is not supported by the megatron conversion (supported: {', '.join(ARCHS)})")
    rope = hf_config.get("rope_parameters") or {}
    heads = hf_config["num_attention_heads"]
    moe = kind == "qwen3_moe"
    return ArchSpec(
        model_type=kind,
        vocab_size=hf_config["vocab_size"],
        hidden_size=hf_config["hidden_size"],
        num_layers=hf_config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf_config.get("num_key_value_heads", heads),
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
        ffn_hidden_size=hf_config["intermediate_size"],
        norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", hf_config.get("rope_theta", 10000.0)),
        max_positions=hf_config.get("max_position_embeddings", 4096),
        tied_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2" or bool(hf_config.get("attention_bias", False)),
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        num_experts=hf_config.get("num_local_experts", hf_config.get("num_experts", 0)) if moe else 0,
        moe_top_k=hf_config.get("num_experts_per_tok", 0) if moe else 0,
        moe_ffn_hidden_size=hf_config.get("moe_intermediate_size", 0) if moe else 0,
        moe_renormalize=bool(hf_config.get("norm_topk_prob", False)),
    )


def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    config = json.loads(path.read_text())
    arch_spec(config, str(path))  # fails here, naming the file, for an unsupported model
    return config


def read_arch(hf_dir: str | Path) -> ArchSpec:
    return arch_spec(read_hf_config(hf_dir))


def _fuse_qkv(spec: ArchSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    groups, rest = spec.num_kv_heads, q.shape[1:]  # rest = (hidden,) for weights, () for biases
    fused = torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)], dim=1)
    return fused.reshape(-1, *rest)  # [(heads + 2 * kv_heads) * head_dim, ...]


def _split_qkv(spec: ArchSpec, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_group = spec.num_heads // spec.num_kv_heads * spec.head_dim
    grouped = fused.reshape(spec.num_kv_heads, per_group + 2 * spec.head_dim, *fused.shape[1:])
    q, k, v = grouped.split([per_group, spec.head_dim, spec.head_dim], dim=1)
    return (t.reshape(-1, *fused.shape[1:]).contiguous() for t in (q, k, v))


def _pad_vocab(spec: ArchSpec, weight: torch.Tensor) -> torch.Tensor:
    return torch.cat([weight, weight.new_zeros(spec.padded_vocab_size - weight.shape[0], weight.shape[1])])


def _layer_to_megatron(spec: ArchSpec, hf: dict, i: int) -> dict[str, torch.Tensor]:
    src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
    attn = f"{src}self_attn."
    out = {
        f"{dst}input_layernorm.weight": hf[f"{src}input_layernorm.weight"],
        f"{dst}pre_mlp_layernorm.weight": hf[f"{src}post_attention_layernorm.weight"],
        f"{dst}self_attention.linear_qkv.weight": _fuse_qkv(spec, *(hf[f"{attn}{p}_proj.weight"] for p in "qkv")),
        f"{dst}self_attention.linear_proj.weight": hf[f"{attn}o_proj.weight"],
    }
    if spec.qkv_bias:
        out[f"{dst}self_attention.linear_qkv.bias"] = _fuse_qkv(spec, *(hf[f"{attn}{p}_proj.bias"] for p in "qkv"))
    if spec.qk_norm:
        out[f"{dst}self_attention.q_layernorm.weight"] = hf[f"{attn}q_norm.weight"]
        out[f"{dst}self_attention.k_layernorm.weight"] = hf[f"{attn}k_norm.weight"]
    if spec.num_experts:
        out[f"{dst}mlp.router.weight"] = hf[f"{src}mlp.gate.weight"]
        for e in range(spec.num_experts):
            out.update(_mlp_to_megatron(hf, f"{src}mlp.experts.{e}.", f"{dst}mlp.experts.local_experts.{e}."))
    else:
        out.update(_mlp_to_megatron(hf, f"{src}mlp.", f"{dst}mlp."))
    return out


def _mlp_to_megatron(hf: dict, src: str, dst: str) -> dict[str, torch.Tensor]:
    return {
        f"{dst}linear_fc1.weight": torch.cat([hf[f"{src}gate_proj.weight"], hf[f"{src}up_proj.weight"]]),  # [2 * ffn, hidden]
        f"{dst}linear_fc2.weight": hf[f"{src}down_proj.weight"],
    }


def hf_to_megatron(spec: ArchSpec, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF state dict (safetensors names) -> unsharded megatron GPTModel state dict."""
    out = {"embedding.word_embeddings.weight": _pad_vocab(spec, hf["model.embed_tokens.weight"]), "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not spec.tied_embeddings:
        out["output_layer.weight"] = _pad_vocab(spec, hf["lm_head.weight"])
    for i in range(spec.num_layers):
        out.update(_layer_to_megatron(spec, hf, i))
    return {k: v.contiguous() for k, v in out.items()}


def _layer_to_hf(spec: ArchSpec, mg: dict, i: int) -> dict[str, torch.Tensor]:
    src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
    attn = f"{dst}self_attn."
    q, k, v = _split_qkv(spec, mg[f"{src}self_attention.linear_qkv.weight"])
    out = {
        f"{dst}input_layernorm.weight": mg[f"{src}input_layernorm.weight"],
        f"{dst}post_attention_layernorm.weight": mg[f"{src}pre_mlp_layernorm.weight"],
        f"{attn}q_proj.weight": q,
        f"{attn}k_proj.weight": k,
        f"{attn}v_proj.weight": v,
        f"{attn}o_proj.weight": mg[f"{src}self_attention.linear_proj.weight"],
    }
    if spec.qkv_bias:
        out.update(zip((f"{attn}{p}_proj.bias" for p in "qkv"), _split_qkv(spec, mg[f"{src}self_attention.linear_qkv.bias"])))
    if spec.qk_norm:
        out[f"{attn}q_norm.weight"] = mg[f"{src}self_attention.q_layernorm.weight"]
        out[f"{attn}k_norm.weight"] = mg[f"{src}self_attention.k_layernorm.weight"]
    if spec.num_experts:
        out[f"{dst}mlp.gate.weight"] = mg[f"{src}mlp.router.weight"]
        for e in range(spec.num_experts):
            out.update(_mlp_to_hf(mg, f"{src}mlp.experts.local_experts.{e}.", f"{dst}mlp.experts.{e}."))
    else:
        out.update(_mlp_to_hf(mg, f"{src}mlp.", f"{dst}mlp."))
    return out


def _mlp_to_hf(mg: dict, src: str, dst: str) -> dict[str, torch.Tensor]:
    gate, up = mg[f"{src}linear_fc1.weight"].chunk(2)
    return {f"{dst}gate_proj.weight": gate, f"{dst}up_proj.weight": up, f"{dst}down_proj.weight": mg[f"{src}linear_fc2.weight"]}


def megatron_to_hf(spec: ArchSpec, mg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unsharded megatron GPTModel state dict -> HF state dict (safetensors names, vocab unpadded)."""
    out = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"][: spec.vocab_size], "model.norm.weight": mg["decoder.final_layernorm.weight"]}
    if not spec.tied_embeddings:
        out["lm_head.weight"] = mg["output_layer.weight"][: spec.vocab_size]
    for i in range(spec.num_layers):
        out.update(_layer_to_hf(spec, mg, i))
    return {k: v.contiguous() for k, v in out.items()}
