"""The Trainer protocol and the packing of samples into padded tensors, shared by every backend.

A trainer owns the policy being optimised and its optimizer state.  The RL and SFT steps in
`miles_core.loop` / `miles_core.train.sft` are written against this protocol only, so a backend
(torch now, megatron-core at scale) supplies forward log-probs and an optimizer step, never a loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from miles_core.algos.losses import loss_weights
from miles_core.samples import Sample

# loss_fn(logprobs [b, T], entropy [b, T], mask [b, T], extras {name: [b, ...]}) ->
#   (per-token loss [b, T], {metric name: per-token values [b, T]})
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, dict]]
# weights_fn(loss mask of one whole mini-batch [b, T]) -> per-token weights [b, T]; the mini-batch's
#   loss is sum(weights * per-token loss), e.g. algos.losses.loss_weights (token-mean by default)
WeightsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    gather_index: torch.Tensor  # [B, T] index into the L-1 next-token positions of each response token
    response_mask: torch.Tensor  # [B, T] 1 where a response token exists
    loss_mask: torch.Tensor  # [B, T] the samples' loss masks, 0 on padding
    rollout_logprobs: torch.Tensor  # [B, T]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: slice) -> "PackedBatch":
        return PackedBatch(*(t[rows] for t in self.__dict__.values()))


def pack(samples: list[Sample], pad_id: int) -> PackedBatch:
    B = len(samples)
    L = max(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
    T = max(len(s.response_tokens) for s in samples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    gather_index = torch.zeros(B, T, dtype=torch.long)
    response_mask = torch.zeros(B, T)
    loss_mask = torch.zeros(B, T)
    rollout_logprobs = torch.zeros(B, T)
    for i, s in enumerate(samples):
        P, R = len(s.prompt_tokens), len(s.response_tokens)
        input_ids[i, : P + R] = torch.tensor(s.prompt_tokens + s.response_tokens)
        attention_mask[i, : P + R] = 1
        gather_index[i, :R] = torch.arange(P - 1, P - 1 + R)  # logits at t predict token t+1
        response_mask[i, :R] = 1
        loss_mask[i, :R] = torch.tensor(s.loss_mask, dtype=torch.float)
        rollout_logprobs[i, :R] = torch.tensor(s.rollout_logprobs)
    return PackedBatch(input_ids, attention_mask, gather_index, response_mask, loss_mask, rollout_logprobs)


class Trainer(Protocol):
    step: int  # optimizer steps taken so far

    def logprobs(self, batch: PackedBatch, temperature: float) -> torch.Tensor:
        """Per-token log-probs [B, T] of the batch's responses under the current policy, no grad."""

    def train_on(self, batch: PackedBatch, extras: dict, loss_fn: LossFn, temperature: float, lr: float | None = None, weights_fn: WeightsFn = loss_weights) -> dict[str, float]:
        """Optimizer steps over the batch (split into mini-batches, each into micro-batches);
        each mini-batch's loss is sum(weights_fn(its loss mask) * loss_fn(...)), computed over the
        whole mini-batch before it is split, so the aggregation does not depend on the micro-batch
        size (or, across data-parallel ranks, on the sharding)."""

    def save(self, ckpt_dir: str) -> None:
        """Model, optimizer, RNG state and step: everything needed to continue bitwise."""

    def export_hf(self, out_dir: str, dtype: str) -> None:
        """The policy as an ordinary HF safetensors directory (weights + config)."""
