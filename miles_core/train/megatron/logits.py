"""Per-token log-probs and entropy from vocab-parallel logits, and sums across parallel ranks.

With tensor parallelism each rank holds a slice of the (padded) vocabulary: log-probs come from
megatron-core's `vocab_parallel_cross_entropy`, and the entropy from an all-reduce of the
slice-wise partition sums (with gradient), so neither gathers the full [b, L, V] logits.
The padding rows of the vocabulary are masked out, so both equal the HF model's values; so are the positions the
model's input gets under sequence parallel, which only makes its length a multiple of the tensor-parallel size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles_core.train.base import PackedBatch

_MASKED = -1e30  # a padded vocab entry's logit: exp() is 0 and 0 * logit stays finite


def positions(input_ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(input_ids.shape[1]).expand_as(input_ids)  # [b, L]


def padded_for_sequence_parallel(input_ids: torch.Tensor) -> torch.Tensor:
    """The model's input [b, L'], L' the next multiple of the tensor-parallel size: sequence parallel splits the
    sequence over the tensor-parallel ranks.  Padded on the right, which a causal model never attends to from an
    earlier position; `response_logprobs_entropy` reads the batch's own positions only."""
    from megatron.core import parallel_state

    extra = -input_ids.shape[1] % parallel_state.get_tensor_model_parallel_world_size()
    return F.pad(input_ids, (0, extra))


def _mask_vocab_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    from megatron.core import parallel_state  # optional backend: imported where used

    width = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    if start + width <= vocab_size:
        return logits
    padded = torch.arange(start, start + width) >= vocab_size  # [V_local]
    return logits.masked_fill(padded, _MASKED)


def _vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [b, s] of softmax(logits) over the full vocabulary from this rank's slice [b, s, V_local]."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    peak = logits.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = logits - peak
    exp = shifted.exp()
    partition = reduce_from_tensor_model_parallel_region(exp.sum(-1))  # [b, s]
    weighted = reduce_from_tensor_model_parallel_region((exp * shifted).sum(-1))  # [b, s]
    return partition.log() - weighted / partition


def response_logprobs_entropy(output: torch.Tensor, batch: PackedBatch, temperature: float, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [b, T], entropy [b, T]) of the response tokens, 0 on padding; in the graph."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    length = batch.input_ids.shape[1]
    logits = _mask_vocab_padding(output[:, : length - 1].float() / temperature, vocab_size)  # [b, L-1, V_local]
    entropy = _vocab_parallel_entropy(logits)  # [b, L-1]
    logprobs = -vocab_parallel_cross_entropy(logits, batch.input_ids[:, 1:])  # [b, L-1]
    return (logprobs.gather(1, batch.gather_index) * batch.response_mask, entropy.gather(1, batch.gather_index) * batch.response_mask)


def from_last_stage(values: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's tensor on every stage (others pass zeros of the same shape)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        values = values if parallel_state.is_pipeline_last_stage() else torch.zeros_like(values)
        dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
    return values


def sum_over_data_and_pipeline(sums: dict[str, torch.Tensor], total_tokens: float) -> dict[str, float]:
    """Per-token means of metric sums held by each data-parallel rank's last pipeline stage."""
    from megatron.core import parallel_state

    names = sorted(sums)
    reduce_to_one = dist.get_world_size() > 1
    if reduce_to_one:  # every rank takes part with the same names; only last pipeline stages have any
        everyone: list[list[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, names)
        names = sorted(set().union(*everyone))
    stacked = torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float64) for k in names]) if names else torch.zeros(0, dtype=torch.float64)
    if reduce_to_one:
        dist.all_reduce(stacked, group=parallel_state.get_data_parallel_group())
        stacked = from_last_stage(stacked)
    return {k: float(v) / max(total_tokens, 1.0) for k, v in zip(names, stacked)}
