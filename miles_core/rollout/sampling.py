"""Token sampling of the embedded engine: HF's top-k/top-p warpers, then one inverse-CDF draw per row.

Shared by the ordinary decode loop (rollout/engines/torch_engine.py) and speculative decoding
(rollout/speculative.py), so both draw from exactly the same distribution.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from miles_core.rollout.base import SamplingParams


def truncate(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [N, V] with every token outside top-k, then top-p, at -inf (HF's warpers)."""
    if params.top_k > 0:
        scaled = TopKLogitsWarper(top_k=params.top_k)(None, scaled)
    if params.top_p < 1.0:
        scaled = TopPLogitsWarper(top_p=params.top_p)(None, scaled)
    return scaled


def draw(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of unnormalised probabilities [B, V], by inverse CDF (one uniform per row) -> [B]."""
    # float64 running sum: in float32 each token's share would carry an absolute error of
    # ~eps * cdf, distorting the rare tail of a large vocabulary; costs the same here
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    uniform = torch.rand((cdf.shape[0], 1), generator=generator, dtype=cdf.dtype) * cdf[:, -1:]  # [B, 1]
    return torch.searchsorted(cdf, uniform, right=True).clamp_(max=cdf.shape[1] - 1).squeeze(-1)


def sample_next_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, V] raw -> (tokens [B], log-probs [B] under softmax(logits / T), unfiltered).

    Sampling uses softmax(logits / T) restricted by top-k then top-p (HF's warpers), drawn by
    inverse CDF. Temperature 0 is argmax, with log-probs under softmax(logits).
    """
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(dim=-1)  # [B]
        logprobs = logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(dim=-1)
        return tokens, logprobs
    scaled = logits / params.temperature if params.temperature != 1.0 else logits  # [B, V]
    row_max = scaled.amax(dim=-1, keepdim=True)  # [B, 1]
    weights = (scaled - row_max).exp_()  # [B, V] unnormalised probabilities
    log_norm = weights.sum(dim=-1).log_() + row_max.squeeze(-1)  # [B]
    if params.top_k > 0 or params.top_p < 1.0:
        weights = weights.masked_fill_(truncate(scaled, params) == float("-inf"), 0.0)
    tokens = draw(weights, generator)
    logprobs = scaled.gather(-1, tokens[:, None]).squeeze(-1) - log_norm
    return tokens, logprobs
