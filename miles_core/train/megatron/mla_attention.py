"""Multi-latent attention's parts on megatron-core 0.16.1's local layer spec (no TransformerEngine).

* LatentDotProductAttention: MLASelfAttention builds its core attention with the query/key head size
  (no-RoPE + RoPE part) and the value head size as `k_channels` / `v_channels`, which only
  TransformerEngine's attention accepts; the local DotProductAttention takes neither and sizes its
  output by `kv_channels`.  Its forward pass already handles a value head size other than the query/key
  one (the softmax scale comes from MLA), so the subclass only takes the two sizes and sizes the output
  by the value heads.
* LatentRMSNorm (norm.py's RMSNorm): megatron-core gives the q and kv latent norms the model's layernorm_epsilon,
  transformers a fixed 1e-6; this keeps transformers' (GLM-4.7-Flash's rms_norm_eps is 1e-5).
* Without TransformerEngine the MLA module's TE flag is set right (below).
Imported only by the megatron backend (arch_config), where MLA is built."""

from __future__ import annotations

import importlib.util

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
