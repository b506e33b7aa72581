"""Policy-gradient losses, per token; the trainer aggregates them.

Follows the PPO clipped surrogate (Schulman et al. 2017) as used by GRPO (DeepSeekMath,
Shao et al. 2024). Departures:
* Asymmetric clip range [1 - eps_low, 1 + eps_high] ("clip-higher", DAPO, Yu et al. 2025);
  PPO and GRPO use one symmetric eps. Pass eps_low == eps_high to recover them.
* The loss is returned per token, unreduced; the trainer weighs it with `loss_weights`, whose
  default is the token-mean over each mini-batch's loss-masked tokens (every token weighs the
  same, DAPO's token-level loss). The GRPO paper's seq-mean-token-mean and Dr.GRPO's constant
  normaliser are the other modes.
* No KL term here: GRPO puts k3 KL to the reference model inside the objective; we compute it
  in `kl.py` and leave adding it (to the loss or to the reward) to the caller.
* No dual-clip (Ye et al. 2020) bound on negative-advantage tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, Tensor]:
    """Clipped surrogate loss per token and the clip indicator per token.

    logprobs, old_logprobs, advantages: [B, T].
    Returns (loss [B, T], clipped [B, T]); `clipped` is 1.0 where the clipped term is the
    larger (active) one and strictly differs from the unclipped one, else 0.0, so its masked
    mean is the usual clip fraction.
    """
    ratio = torch.exp(logprobs - old_logprobs)  # [B, T]
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)  # [B, T]
    loss = torch.maximum(unclipped, clipped)  # [B, T]
    clip_active = (clipped > unclipped).to(loss.dtype)  # [B, T]
    return loss, clip_active


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask) / max(sum(mask), 1), over `dim` or everything.

    values, mask: same shape (mask 0/1, any dtype). An all-zero mask gives 0, not NaN.
    """
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)  # []
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)  # shape minus `dim`


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def loss_weights(mask: Tensor, mode: str = "token-mean", horizon: int = 1) -> Tensor:
    """Per-token weights w [B, T] such that a mini-batch's loss is sum(w * per-token loss).

    mask: [B, T] the mini-batch's loss mask; B sequences, L_i = sum of row i.
    token-mean               w = mask / sum(L_i)          every token weighs the same (DAPO)
    seq-mean-token-mean      w = mask / (B * L_i)         mean per sequence, then over sequences (GRPO)
    seq-mean-token-sum       w = mask / B                 sum per sequence, mean over sequences
    seq-mean-token-sum-norm  w = mask / (B * horizon)     Dr.GRPO: a constant normaliser, horizon =
                                                          the generation budget, so length carries no bias
    Rows with an empty mask get weight 0.
    """
    mask = mask.float()
    rows = mask.shape[0]
    if mode == "token-mean":
        return mask / mask.sum().clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        return mask / (rows * mask.sum(dim=1, keepdim=True).clamp(min=1.0))
    if mode == "seq-mean-token-sum":
        return mask / rows
    if mode == "seq-mean-token-sum-norm":
        return mask / (rows * horizon)
    raise ValueError(f"unknown loss aggregation {mode!r} (available: {', '.join(AGGREGATIONS)})")
