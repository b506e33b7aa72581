"""megatron-core's TransformerConfig, layer specs and rotary options for an ArchSpec (one place per family feature).

* Dense GQA families: TransformerConfig with the fused q/k/v of the local layer spec.
* Multi-latent attention (DeepSeek-V2/V3, Kimi-K2.5, GLM-4.7-Flash): MLATransformerConfig and the local spec's
  MLASelfAttention; RoPE or YaRN inside the attention, as megatron-core computes MLA's RoPE itself.
* Partial rotary heads (GLM-4.5): the GPTModel's rotary_percent.
* gpt-oss: YaRN through GPTModel's "yarn" position embedding (yarn_config.py); attention sinks as the learnable
  softmax offset and sliding windows per layer (`window_attn_skip_freq` as a list), both of which the local
  DotProductAttention applies in its unfused softmax; biases on every linear layer and the router; the clamped
  SwiGLU as quick_gelu with `activation_func_clamp_value` and `glu_linear_offset` 1; the experts' fc2 of
  expert_linear.py, which training with biased experts needs when they are not split over ranks.
* MoE: softmax top-k (Qwen3-MoE, DeepSeek-V2) or sigmoid scores with the correction bias as `expert_bias`
  (DeepSeek, GLM), group-limited top-k, routed_scaling_factor, shared experts, and dense first
  layers through `moe_layer_freq`.  The router runs in fp32 as HF's does.  The expert bias is kept
  as the checkpoint has it (update rate 0): the torch backend does not move it either, and an RL
  step should not shift routing on its own.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

import torch
import torch.nn.functional as F

from miles_core.checkpoint.arch import ArchSpec

_CPU_SAFE = dict(
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    masked_softmax_fusion=False,
    gradient_accumulation_fusion=False,
)


def _moe(spec: ArchSpec) -> dict:
    if not spec.num_experts:
        return {}
    moe = dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_top_k,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_router_dtype="fp32",
        moe_layer_freq=[int(spec.is_moe_layer(i)) for i in range(spec.num_layers)],
        moe_router_topk_scaling_factor=spec.moe_scaling if spec.moe_scaling != 1.0 else None,
    )
    if spec.moe_groups:
        moe |= dict(moe_router_num_groups=spec.moe_groups, moe_router_group_topk=spec.moe_group_top_k)
    if spec.moe_shared_ffn_hidden_size:
        moe |= dict(moe_shared_expert_intermediate_size=spec.moe_shared_ffn_hidden_size)
    if not spec.moe_sigmoid:  # Qwen3-MoE, DeepSeek-V2: softmax over all experts, then top-k, unless renormalised
        return moe | dict(moe_router_pre_softmax=not spec.moe_renormalize)
    return moe | dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)


def _attention(spec: ArchSpec) -> dict:
    fields = dict(softmax_type="learnable" if spec.attention_sinks else "vanilla")
    if spec.sliding_window:  # megatron's window counts the tokens before the query, HF's sliding_window the query too
        windowed = [int(i in spec.windowed_layers) for i in range(spec.num_layers)]
        fields |= dict(window_size=(spec.sliding_window - 1, 0), window_attn_skip_freq=windowed)
    return fields


def _activation(spec: ArchSpec) -> dict:
    if not spec.swiglu_limit:
        return dict(activation_func=F.silu)
    from megatron.core.fusions.fused_bias_geglu import quick_gelu  # optional backend: imported where used

    return dict(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=spec.swiglu_limit)


def _gqa_yarn(spec: ArchSpec) -> dict:
    from miles_core.train.megatron.yarn_config import GQA_SETTINGS, yarn_fields

    return yarn_fields(spec.yarn, GQA_SETTINGS)


def _mla(spec: ArchSpec) -> dict:
    mla = spec.mla
    fields = dict(
        q_lora_rank=mla.q_lora_rank or None,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        rotary_base=spec.rope_theta,
        rope_type="yarn" if spec.yarn else "rope",
    )
    if not spec.yarn:
        return fields
    from miles_core.train.megatron.yarn_config import MLA_SETTINGS, yarn_fields

    return fields | yarn_fields(spec.yarn, MLA_SETTINGS)


def _config_class(spec: ArchSpec):
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig  # optional backend: imported where used

    if spec.mla:
        return MLATransformerConfig
    if spec.yarn:
        from miles_core.train.megatron.yarn_config import YarnTransformerConfig

        return YarnTransformerConfig
    return TransformerConfig


def _rotary(spec: ArchSpec) -> dict:
    return _mla(spec) if spec.mla else _gqa_yarn(spec) if spec.yarn else {}


def transformer_config(spec: ArchSpec, parallel, dtype: torch.dtype):
    """The (MLA / YaRN)TransformerConfig of the model at these parallel sizes."""
    return _config_class(spec)(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        add_bias_linear=spec.linear_bias,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm or spec.mla is not None,  # MLA: the norms of the q and kv latents
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=1,
        sequence_parallel=parallel.tensor > 1,  # megatron-core trains MoE at TP > 1 only so; dense layers too, as Megatron-LM recipes do
        **_CPU_SAFE,
        **_activation(spec),
        **_attention(spec),
        **_rotary(spec),
        **_moe(spec),
    )


def _latent_attention(layer):
    """An MLA layer spec with whole down-projections on every tensor-parallel rank, the core attention that takes MLA's
    head sizes and HF's latent norms (mla_attention.py)."""
    from miles_core.train.megatron.mla_attention import LatentAttention, LatentDotProductAttention, LatentRMSNorm

    attention = layer.submodules.self_attention
    parts = replace(attention.submodules, core_attention=LatentDotProductAttention, q_layernorm=LatentRMSNorm, kv_layernorm=LatentRMSNorm)
    attention = replace(attention, module=LatentAttention, submodules=parts)
    return replace(layer, submodules=replace(layer.submodules, self_attention=attention))


def _unreduced_expert_output(layer):
    """An MoE layer spec whose experts' fc2 skips the reduce over a one-rank group (expert_linear.py); dense layers as they are."""
    from miles_core.train.megatron.expert_linear import ExpertRowParallelLinear

    mlp = layer.submodules.mlp
    if not hasattr(mlp.submodules, "experts"):
        return layer
    experts = mlp.submodules.experts
    experts = replace(experts, submodules=replace(experts.submodules, linear_fc2=ExpertRowParallelLinear))
    mlp = replace(mlp, submodules=replace(mlp.submodules, experts=experts))
    return replace(layer, submodules=replace(layer.submodules, mlp=mlp))


def _adapted(spec: ArchSpec, layer):
    """The local spec's layer with our own parts where a family needs them: MLA's core attention, biased experts' fc2."""
    if spec.mla:
        layer = _latent_attention(layer)
    if spec.linear_bias and spec.num_experts:
        layer = _unreduced_expert_output(layer)
    return layer


def _sequence_parallel_norms(part):
    """A spec (or part of one) with every norm of the local spec (torch's, or Apex's LayerNorm where Apex is installed)
    replaced by the RMSNorm that also takes sequence parallel."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from miles_core.train.megatron.norm import SequenceParallelRMSNorm

    if part in (WrappedTorchNorm, FusedLayerNorm):
        return SequenceParallelRMSNorm
    if isinstance(part, list):
        return [_sequence_parallel_norms(p) for p in part]
    if is_dataclass(part) and not isinstance(part, type):
        return replace(part, **{f.name: _sequence_parallel_norms(getattr(part, f.name)) for f in fields(part) if f.init})
    return part


def layer_spec(spec: ArchSpec, config, lora=None):
    """This pipeline stage's layers on the local (no TransformerEngine) spec, dense and MoE layers each as the config
    says, with norm.py's norm and our own parts where a family needs them; LoRA adapters (lora.py) where `lora` targets."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = _sequence_parallel_norms(get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm"))
    layers = [_adapted(spec, layer) for layer in block.layer_specs]
    if lora is not None:
        from miles_core.train.megatron.lora import with_adapters

        layers = [with_adapters(layer, lora) for layer in layers]
    return replace(block, layer_specs=layers)


def rotary_options(spec: ArchSpec) -> dict:
    """GPTModel's position-embedding arguments (MLA applies its RoPE inside the attention, from the config)."""
    return dict(position_embedding_type="yarn" if spec.yarn and not spec.mla else "rope", rotary_base=int(spec.rope_theta), rotary_percent=spec.rotary_fraction)
