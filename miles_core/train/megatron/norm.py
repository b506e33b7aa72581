"""The RMSNorm of every layer on megatron-core 0.16.1's local layer spec, sequence parallel included.

The local spec builds its norms with WrappedTorchNorm (torch's RMSNorm), which refuses sequence parallel: under it
a norm sees only its rank's part of the sequence, so the gradient of its weight is partial and must be summed over
the tensor-parallel ranks.  megatron-core's finalize_model_grads sums the parameters marked `sequence_parallel`, as
TransformerEngine's and Apex's norms mark theirs; this norm is torch's RMSNorm with that mark.
Imported only by the megatron backend (arch_config, mla_attention), where layers are built.
"""

from __future__ import annotations

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, its weight's gradient summed over tensor-parallel ranks when the config is sequence parallel."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
