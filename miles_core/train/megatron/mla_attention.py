"""Multi-latent attention's parts on megatron-core 0.16.1's local layer spec (no TransformerEngine).

* LatentDotProductAttention: MLASelfAttention builds its core attention with the query/key head size
  (no-RoPE + RoPE part) and the value head size as `k_channels` / `v_channels`, which only
  TransformerEngine's attention accepts; the local DotProductAttention takes neither and sizes its
  output by `kv_channels`.  Its forward pass already handles a value head size other than the query/key
  one (the softmax scale comes from MLA), so the subclass only takes the two sizes and sizes the output
  by the value heads.
* LatentAttention: MLASelfAttention whose q and kv down-projections are whole on every tensor-parallel rank
  (ReplicatedLinear), as TransformerEngine's spec builds them.  The local spec's column-parallel down-projection
  splits the latent and the RoPE key over the ranks and gathers them; its backward keeps each rank's share of the
  gather's gradient, yet every rank's heads use the whole RoPE key, so each share misses the other ranks' heads.
  Whole on every rank, each computes its own part of the sequence (sequence parallel, on at TP > 1), and MLA gathers
  the RoPE key over the ranks, whose backward sums the heads' gradients; the weights' gradients, each from a part of
  the sequence, are summed over the ranks by finalize_model_grads (marked `sequence_parallel`, as norm.py's norms).
* LatentRMSNorm (norm.py's RMSNorm): megatron-core gives the q and kv latent norms the model's layernorm_epsilon,
  transformers a fixed 1e-6; this keeps transformers' (GLM-4.7-Flash's rms_norm_eps is 1e-5).
* Without TransformerEngine the MLA module's TE flag is set right (below).
Imported only by the megatron backend (arch_config), where MLA is built."""

from __future__ import annotations

import importlib.util

import torch
from megatron.core.transformer import multi_latent_attention  # the optional backend's own modules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.utils import divide

from miles_core.train.megatron.norm import SequenceParallelRMSNorm

LATENT_NORM_EPS = 1e-6  # transformers' DeepSeek-V3 and GLM-4.7-Flash build the q/kv latent norms with it, whatever rms_norm_eps says

if importlib.util.find_spec("transformer_engine") is None:
    # without TransformerEngine, 0.16.1's TE classes are stand-in mocks yet HAVE_TE is True there, and MLA's
    # isinstance(linear_proj, TELinear) check then raises TypeError: the check is for TE's fp8 path only
    multi_latent_attention.HAVE_TE = False


class LatentDotProductAttention(DotProductAttention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, k_channels=None, v_channels=None, softmax_scale=None, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, attention_type, softmax_scale=softmax_scale, **kwargs)
        if v_channels is not None:  # the base Attention first builds one without sizes, which MLA then replaces
            self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads, self.tp_group.size())  # [sq, b, heads * v_head_dim]


class LatentRMSNorm(SequenceParallelRMSNorm):
    """The RMSNorm of MLA's q and kv latents (each rank's part of the sequence under sequence parallel), with
    transformers' epsilon."""

    def __init__(self, config, hidden_size: int, eps: float = LATENT_NORM_EPS, **kwargs):
        super().__init__(config, hidden_size, eps=LATENT_NORM_EPS)


class ReplicatedLinear(torch.nn.Module):
    """A bias-free linear layer whole on every tensor-parallel rank, applied to the rank's own tokens; its weight's
    gradient summed over the ranks under sequence parallel.  Returns (output, None) as megatron's linear layers do."""

    def __init__(self, input_size: int, output_size: int, config):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        with torch.no_grad():
            config.init_method(self.weight)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states):
        return torch.nn.functional.linear(hidden_states, self.weight), None


class LatentAttention(multi_latent_attention.MLASelfAttention):
    """MLASelfAttention with its down-projections whole on every tensor-parallel rank (module docstring)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if config.q_lora_rank is not None:
            self.linear_q_down_proj = ReplicatedLinear(config.hidden_size, config.q_lora_rank, config)
        self.linear_kv_down_proj = ReplicatedLinear(config.hidden_size, config.kv_lora_rank + config.qk_pos_emb_head_dim, config)
