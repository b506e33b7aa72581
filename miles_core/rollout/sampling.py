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


BLOCK = 64  # vocabulary entries per block of `draw`'s and `argmax`'s first level


def _per_block(values: torch.Tensor, reduce) -> torch.Tensor:
    """[B, V] -> [B, nb]: `reduce(x, -1, keepdim)` over each block of BLOCK consecutive entries (the last one shorter
    when BLOCK does not divide V)."""
    whole = values.shape[-1] - values.shape[-1] % BLOCK
    blocks = reduce(values[:, :whole].unflatten(-1, (-1, BLOCK)), -1, False)  # [B, V // BLOCK]
    if whole < values.shape[-1]:
        blocks = torch.cat([blocks, reduce(values[:, whole:], -1, True)], dim=-1)
    return blocks


def _in_block(values: torch.Tensor, block: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of each row's block [B, 1] -> (their indices [B, BLOCK], their values [B, BLOCK], `fill` past V)."""
    index = block * BLOCK + torch.arange(BLOCK, device=values.device)  # [B, BLOCK]
    return index, values.gather(-1, index.clamp(max=values.shape[-1] - 1)).masked_fill_(index >= values.shape[-1], fill)


def _last_weighted(cdf: torch.Tensor) -> torch.Tensor:
    """Running sums [B, N] -> [B, 1] index of the last entry that adds weight (where the sum reaches its total)."""
    return torch.searchsorted(cdf, cdf[:, -1:].contiguous())


def draw(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of unnormalised probabilities [B, V], by inverse CDF (one uniform per row) -> [B].

    The uniform, scaled to the row's total, picks a block of BLOCK consecutive tokens by the running sum of block
    masses, then the token inside it by the block's own running sum: the token a single running sum over V would
    pick (up to rounding), while only [B, V / BLOCK] and [B, BLOCK] running sums are formed.  A float64 cumsum of
    the whole [B, V] cost ~16 ms a step at [256, 8192] here (a fresh 16 MB buffer each step), more than the draw's
    softmax and the forward pass of a tiny model together.
    """
    # Running sums in float64: in float32 each token's share would carry an absolute error of ~eps * cdf,
    # distorting the rare tail of a large vocabulary.  A block's mass is a float32 sum of 64 entries: its error
    # is relative to that block (~eps), as the float32 probabilities' own, so no tail is distorted.
    block_cdf = _per_block(weights, torch.sum).cumsum(dim=-1, dtype=torch.float64)  # [B, nb] running sums of block masses
    uniform = torch.rand((weights.shape[0], 1), generator=generator, dtype=torch.float64).to(weights.device)  # a CPU generator on any device
    target = uniform * block_cdf[:, -1:]  # [B, 1]
    block = torch.searchsorted(block_cdf, target, right=True).minimum(_last_weighted(block_cdf))  # [B, 1]
    below = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp_(min=0)), 0.0)  # [B, 1] mass before the block
    _, inside = _in_block(weights, block, 0.0)  # [B, BLOCK]
    inner_cdf = inside.cumsum(dim=-1, dtype=torch.float64)  # [B, BLOCK]
    within = (target - below) * (inner_cdf[:, -1:] / (block_cdf.gather(-1, block) - below))  # [B, 1] on the inner scale
    token = torch.searchsorted(inner_cdf, within, right=True).minimum(_last_weighted(inner_cdf))  # [B, 1]
    return (block * BLOCK + token).squeeze(-1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` of [B, V] -> [B]: the first maximal index (a NaN counts as maximal), found as the first
    block of BLOCK entries holding the row's maximum, then the first maximum inside it. torch's argmax is not
    vectorized on the CPU: 0.45 ms at [64, 8192] and 33 ms at [256, 152064], where `amax` takes 0.03 and 7 ms."""
    index, inside = _in_block(logits, _per_block(logits, torch.amax).argmax(-1, keepdim=True), float("-inf"))  # [B, BLOCK]
    return index.gather(-1, inside.argmax(-1, keepdim=True)).squeeze(-1)


def sample_next_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, V] raw -> (tokens [B], log-probs [B] under softmax(logits / T), unfiltered).

    Sampling uses softmax(logits / T) restricted by top-k then top-p (HF's warpers), drawn by
    inverse CDF. Temperature 0 is argmax, with log-probs under softmax(logits).
    overwrite: the caller is done with `logits`, so they may hold the probabilities (a fresh [B, V]
    buffer each step costs its page faults: ~5 ms a step at [256, 8192] on this CPU).
    """
    raw, logits = logits, logits.float()
    if params.greedy:
        tokens = argmax(logits)  # [B], taken before the softmax may write over `logits`
        probs = torch.softmax(logits, dim=-1, out=logits if overwrite or logits is not raw else None)  # half logsumexp's time here
        return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log_()
    scaled = logits / params.temperature if params.temperature != 1.0 else logits  # [B, V]
    dropped = truncate(scaled, params) == float("-inf") if params.top_k > 0 or params.top_p < 1.0 else None  # [B, V]
    probs = torch.softmax(scaled, dim=-1, out=scaled if overwrite or scaled is not raw else None)  # [B, V]
    if dropped is not None:
        probs = probs.masked_fill_(dropped, 0.0)  # a drawn token keeps its probability
    tokens = draw(probs, generator)
    # log of the drawn token's probability: every token that can be drawn has one of at least ~1e-38 (a normal
    # float, to a relative eps), so this equals log_softmax at the token without another pass over [B, V]
    logprobs = probs.gather(-1, tokens[:, None]).squeeze(-1).log_()
    return tokens, logprobs
