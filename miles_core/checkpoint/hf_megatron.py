"""HF <-> megatron-core GPTModel weight mapping for every family in `arch.ARCHS` (dense GQA, Qwen3-MoE, MLA, DeepSeek MoE, gpt-oss).

Pure tensor code (no megatron import): an HF state dict as stored in `model.safetensors` maps to
the state dict of an unsharded (TP=PP=EP=1) GPTModel built with the local layer spec, and back.
Sharding is megatron's business: `miles_core.checkpoint.torch_dist` saves this state with
`dist_checkpointing`, which reshards it to any TP/PP/EP on load.

Each layer is a list of Links, one per megatron tensor: the HF tensors it is made of, how they are
joined (HF -> megatron) and split (megatron -> HF), so both directions read the same table.
* q/k/v projections (GQA) fuse into `linear_qkv`, grouped per KV head: for each of the
  num_kv_heads groups, that group's query heads, then its key head, then its value head; biases
  (Qwen2, GLM-4.5) the same way.  q/k norms (Qwen3, GLM-4.5 with use_qk_norm) map to `q_layernorm` / `k_layernorm`.
* Multi-latent attention (DeepSeek-V2/V3, Kimi-K2.5, GLM-4.7-Flash) maps one to one: q_a/q_b -> linear_q_down/up_proj,
  kv_a_proj_with_mqa/kv_b -> linear_kv_down/up_proj and their norms; megatron-core splits heads into
  no-RoPE and RoPE parts in HF's order and de-interleaves the RoPE part as HF's `rope_interleave` does.
* gate/up projections (SwiGLU) fuse into `linear_fc1` as [gate; up]; experts and shared experts likewise.
  A sigmoid router's `e_score_correction_bias` is megatron's `router.expert_bias` buffer (fp32 in both, and
  in every published dtype: `keeps_fp32`).
* gpt-oss stacks its experts (`experts.gate_up_proj` [experts, hidden, 2 * ffn], `x @ W` layout) with gate and up
  interleaved (gate columns even, up columns odd): each expert's slice, transposed and de-interleaved, is its
  `linear_fc1` [gate; up] (biases likewise), `down_proj` transposed its `linear_fc2`.  Its output projection, router
  and experts carry biases, and its attention sinks are the core attention's learnable `softmax_offset`.
* The vocabulary is padded with zero rows to a multiple of VOCAB_PAD_MULTIPLE, independent of the
  TP size so one checkpoint loads at any TP; the padding is cut on the way back.
* Tied embeddings have no `output_layer`; untied ones map `lm_head` to it.
* A multimodal checkpoint (Kimi-K2.5) converts its text model: its `language_model.` tensors, named as
  the text causal LM's; the way back writes that text model (as the torch backend publishes it).
  Multi-token-prediction layers of a checkpoint are not read (transformers does not build them either).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from miles_core.checkpoint.arch import ARCHS, MULTIMODAL, VOCAB_PAD_MULTIPLE, ArchSpec, arch_spec, megatron_refusal, text_config

__all__ = ["ARCHS", "VOCAB_PAD_MULTIPLE", "ArchSpec", "arch_spec", "export_config", "hf_to_megatron", "keeps_fp32", "megatron_refusal", "megatron_to_hf"]
# multimodal model_type -> (prefix of its text model's tensors, renamings inside it as checkpoints spell them)
TEXT_WEIGHTS = {"kimi_k25": ("language_model.", (("model.blocks.", "model.layers."),))}
_TEXT_CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM"}
# model_type -> its experts' tensors that hold every expert of a layer stacked on the first dimension
STACKED_EXPERTS = {"gpt_oss": ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}


def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    config = json.loads(path.read_text())
    arch_spec(config, str(path))  # fails here, naming the file, for a family megatron cannot train
    return config


def read_arch(hf_dir: str | Path) -> ArchSpec:
    return arch_spec(read_hf_config(hf_dir))


def keeps_fp32(spec: ArchSpec, hf_name: str) -> bool:
    """A sigmoid router's weight and correction bias stay fp32 in any published dtype, as transformers keeps them
    (`_keep_in_fp32_modules_strict`) and megatron keeps the bias: rounding the bias would change which experts win."""
    return spec.moe_sigmoid and hf_name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))


def export_config(hf_config: dict) -> dict:
    """The config.json of the HF model megatron_to_hf's tensors form: a multimodal checkpoint's text causal LM."""
    kind = hf_config.get("model_type")
    if kind not in MULTIMODAL:
        return hf_config
    return {**text_config(hf_config), "architectures": [_TEXT_CLASSES[MULTIMODAL[kind]]]}


def text_weights(spec: ArchSpec, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The causal LM's tensors of an HF state dict under the text model's names (the vision tower left out)."""
    if spec.model_type not in TEXT_WEIGHTS:
        return hf
    prefix, renames = TEXT_WEIGHTS[spec.model_type]
    out = {}
    for name, tensor in hf.items():
        if name.startswith(prefix):
            name = name[len(prefix) :]
            for old, new in renames:
                name = new + name[len(old) :] if name.startswith(old) else name
            out[name] = tensor
    return out


def _stacked_names(spec: ArchSpec) -> list[tuple[str, str]]:
    """(stacked tensor, its per-expert name with `{}` for the expert) for every layer."""
    return [
        (f"model.layers.{i}.mlp.experts.{name}", f"model.layers.{i}.mlp.experts.{{}}.{name}")
        for i in range(spec.num_layers)
        for name in STACKED_EXPERTS.get(spec.model_type, ())
    ]


def unstack_experts(spec: ArchSpec, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with stacked expert tensors split into one tensor per expert (`experts.{e}.<name>`)."""
    out = dict(hf)
    for stacked, each in _stacked_names(spec):
        out |= {each.format(e): t for e, t in enumerate(out.pop(stacked).unbind(0))}
    return out


def stack_experts(spec: ArchSpec, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `unstack_experts`."""
    out = dict(hf)
    for stacked, each in _stacked_names(spec):
        out[stacked] = torch.stack([out.pop(each.format(e)) for e in range(spec.num_experts)])
    return out


def _only(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0]


def _whole(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts)  # [gate; up]: [2 * ffn, hidden]


def _halves(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.chunk(2))


def _fuse_qkv(spec: ArchSpec, parts: list[torch.Tensor]) -> torch.Tensor:
    groups, rest = spec.num_kv_heads, parts[0].shape[1:]  # rest = (hidden,) for weights, () for biases
    fused = torch.cat([p.reshape(groups, -1, *rest) for p in parts], dim=1)
    return fused.reshape(-1, *rest)  # [(heads + 2 * kv_heads) * head_dim, ...]


def _split_qkv(spec: ArchSpec, fused: torch.Tensor) -> list[torch.Tensor]:
    per_group = spec.num_heads // spec.num_kv_heads * spec.head_dim
    grouped = fused.reshape(spec.num_kv_heads, per_group + 2 * spec.head_dim, *fused.shape[1:])
    return [t.reshape(-1, *fused.shape[1:]) for t in grouped.split([per_group, spec.head_dim, spec.head_dim], dim=1)]


def _pad_vocab(spec: ArchSpec, parts: list[torch.Tensor]) -> torch.Tensor:
    weight = parts[0]
    return torch.cat([weight, weight.new_zeros(spec.padded_vocab_size - weight.shape[0], weight.shape[1])])


def _unpad_vocab(spec: ArchSpec, weight: torch.Tensor) -> list[torch.Tensor]:
    return [weight[: spec.vocab_size]]


@dataclass(frozen=True)
class Link:
    """One megatron tensor, the HF tensors it is made of, and the two directions between them."""

    mg: str
    hf: tuple[str, ...]
    join: Callable[[list[torch.Tensor]], torch.Tensor] = _only  # HF tensors -> megatron tensor
    split: Callable[[torch.Tensor], list[torch.Tensor]] = _whole  # megatron tensor -> HF tensors


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Rows [g0, u0, g1, u1, ...] -> [g0, g1, ...; u0, u1, ...]."""
    return torch.cat([t[::2], t[1::2]])


def _interleave(t: torch.Tensor) -> torch.Tensor:
    return torch.stack(t.chunk(2), dim=1).reshape(t.shape)


def _fc1_of_gate_up(parts: list[torch.Tensor]) -> torch.Tensor:
    return _deinterleave(parts[0].T)  # [hidden, 2 * ffn] interleaved -> [gate; up] rows


def _gate_up_of_fc1(t: torch.Tensor) -> list[torch.Tensor]:
    return [_interleave(t).T]


def _fc1_bias_of_gate_up(parts: list[torch.Tensor]) -> torch.Tensor:
    return _deinterleave(parts[0])


def _gate_up_bias_of_fc1(t: torch.Tensor) -> list[torch.Tensor]:
    return [_interleave(t)]


def _transposed(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0].T


def _transposed_back(t: torch.Tensor) -> list[torch.Tensor]:
    return [t.T]


def _copy(pairs: dict[str, str], dst: str, src: str) -> list[Link]:
    return [Link(dst + mg, (src + hf,)) for mg, hf in pairs.items()]


def _swiglu(dst: str, src: str) -> list[Link]:
    return [
        Link(f"{dst}linear_fc1.weight", (f"{src}gate_proj.weight", f"{src}up_proj.weight"), _cat, _halves),
        Link(f"{dst}linear_fc2.weight", (f"{src}down_proj.weight",)),
    ]


def _gqa(spec: ArchSpec, dst: str, src: str) -> list[Link]:
    fuse, split = partial(_fuse_qkv, spec), partial(_split_qkv, spec)
    links = [Link(f"{dst}linear_qkv.weight", tuple(f"{src}{p}_proj.weight" for p in "qkv"), fuse, split)]
    if spec.qkv_bias:
        links.append(Link(f"{dst}linear_qkv.bias", tuple(f"{src}{p}_proj.bias" for p in "qkv"), fuse, split))
    if spec.qk_norm:
        links += _copy({"q_layernorm.weight": "q_norm.weight", "k_layernorm.weight": "k_norm.weight"}, dst, src)
    if spec.attention_sinks:
        links += _copy({"core_attention.softmax_offset": "sinks"}, dst, src)
    if spec.linear_bias:
        links += _copy({"linear_proj.bias": "o_proj.bias"}, dst, src)
    return links + _copy({"linear_proj.weight": "o_proj.weight"}, dst, src)


def _mla(spec: ArchSpec, dst: str, src: str) -> list[Link]:
    pairs = {"linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight", "kv_layernorm.weight": "kv_a_layernorm.weight"}
    pairs |= {"linear_kv_up_proj.weight": "kv_b_proj.weight", "linear_proj.weight": "o_proj.weight"}
    if spec.mla.q_lora_rank:
        pairs |= {"linear_q_down_proj.weight": "q_a_proj.weight", "q_layernorm.weight": "q_a_layernorm.weight", "linear_q_up_proj.weight": "q_b_proj.weight"}
    else:
        pairs["linear_q_proj.weight"] = "q_proj.weight"
    return _copy(pairs, dst, src)


def _stacked_expert(dst: str, src: str) -> list[Link]:
    """One gpt-oss expert, `src` naming its slice of the stacked tensors (`unstack_experts`)."""
    return [
        Link(f"{dst}linear_fc1.weight", (f"{src}gate_up_proj",), _fc1_of_gate_up, _gate_up_of_fc1),
        Link(f"{dst}linear_fc1.bias", (f"{src}gate_up_proj_bias",), _fc1_bias_of_gate_up, _gate_up_bias_of_fc1),
        Link(f"{dst}linear_fc2.weight", (f"{src}down_proj",), _transposed, _transposed_back),
        Link(f"{dst}linear_fc2.bias", (f"{src}down_proj_bias",)),
    ]


def _gpt_oss_mlp(spec: ArchSpec, dst: str, src: str) -> list[Link]:
    links = _copy({"router.weight": "router.weight", "router.bias": "router.bias"}, dst, src)
    for e in range(spec.num_experts):
        links += _stacked_expert(f"{dst}experts.local_experts.{e}.", f"{src}experts.{e}.")
    return links


def _mlp(spec: ArchSpec, i: int, dst: str, src: str) -> list[Link]:
    if spec.model_type in STACKED_EXPERTS:
        return _gpt_oss_mlp(spec, dst, src)
    if not spec.is_moe_layer(i):
        return _swiglu(dst, src)
    links = [Link(f"{dst}router.weight", (f"{src}gate.weight",))]
    if spec.moe_sigmoid:
        links.append(Link(f"{dst}router.expert_bias", (f"{src}gate.e_score_correction_bias",)))
    for e in range(spec.num_experts):
        links += _swiglu(f"{dst}experts.local_experts.{e}.", f"{src}experts.{e}.")
    if spec.moe_shared_ffn_hidden_size:
        links += _swiglu(f"{dst}shared_experts.", f"{src}shared_experts.")
    return links


def links(spec: ArchSpec) -> list[Link]:
    """Every tensor of the unsharded GPTModel with the HF tensors it comes from."""
    pad, unpad = partial(_pad_vocab, spec), partial(_unpad_vocab, spec)
    out = [Link("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), pad, unpad), Link("decoder.final_layernorm.weight", ("model.norm.weight",))]
    if not spec.tied_embeddings:
        out.append(Link("output_layer.weight", ("lm_head.weight",), pad, unpad))
    for i in range(spec.num_layers):
        dst, src = f"decoder.layers.{i}.", f"model.layers.{i}."
        out += _copy({"input_layernorm.weight": "input_layernorm.weight", "pre_mlp_layernorm.weight": "post_attention_layernorm.weight"}, dst, src)
        out += (_mla if spec.mla else _gqa)(spec, f"{dst}self_attention.", f"{src}self_attn.")
        out += _mlp(spec, i, f"{dst}mlp.", f"{src}mlp.")
    return out


def hf_to_megatron(spec: ArchSpec, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF state dict (safetensors names) -> unsharded megatron GPTModel state dict."""
    hf = unstack_experts(spec, text_weights(spec, hf))
    return {link.mg: link.join([hf[name] for name in link.hf]).contiguous() for link in links(spec)}


def megatron_to_hf(spec: ArchSpec, mg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unsharded megatron GPTModel state dict -> HF state dict of the (text) causal LM (safetensors names, vocab unpadded)."""
    return stack_experts(spec, {name: t.contiguous() for link in links(spec) for name, t in zip(link.hf, link.split(mg[link.mg]))})
