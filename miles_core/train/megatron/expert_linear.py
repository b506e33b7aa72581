"""The output projection of biased experts (gpt-oss) on megatron-core 0.16.1's local layer spec.

An expert MLP scales its fc2 bias by the routing weights and adds it in place to the fc2 output.  With one rank
in the expert tensor-parallel group and no expert parallelism, RowParallelLinear still passes that output through
the tensor-parallel reduce, whose autograd function hands its input back as is; training then fails on the in-place
add ("Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace").  A reduce over a group
of one is the identity, so this projection skips it, as RowParallelLinear itself does whenever the experts are split
over ranks (`explicit_expert_comm`).
Under sequence parallel RowParallelLinear marks its bias `sequence_parallel`, for finalize_model_grads to sum its
gradient over the tensor-parallel ranks; an expert's bias is no such weight: its gradient is whole on the rank that
holds the expert (or summed over the expert data-parallel ranks by DDP), and summed over tensor-parallel ranks it would
be added to other experts' biases.  Nor is it a copy of a tensor-parallel rank's: with the experts split over ranks
that are also tensor-parallel ranks, each holds its own experts' biases, and the grad norm, which counts a parameter
not marked `tensor_model_parallel` on tensor-parallel rank 0 only, would leave the others' out.  Imported only by the megatron backend (arch_config), where such experts are built.
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import RowParallelLinear  # the optional backend's own class


class ExpertRowParallelLinear(RowParallelLinear):
    """An expert's fc2: its output leaves unreduced, the partial sums of its expert tensor-parallel ranks (if any)
    summed by the token dispatcher as for split experts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.explicit_expert_comm = True
        if self.bias is not None:
            self.bias.sequence_parallel, self.bias.tensor_model_parallel = False, True
