"""Policy-gradient and value losses, per token; the trainer aggregates them.

* ppo_clip_loss: the PPO clipped surrogate (Schulman et al. 2017) as used by GRPO, with
  DAPO's asymmetric range and optional dual clip (Ye et al. 2020).
* gspo_loss: GSPO's sequence-level ratio (Zheng et al. 2025), clipped per sequence.
* cispo_loss: CISPO (MiniMax-M1, 2025): the clipped importance weight is a constant (no
  gradient) multiplying a REINFORCE term, so clipped tokens still get gradient.
* value_loss: PPO's clipped value loss for the critic.

Departures of ppo_clip_loss from PPO / GRPO:
* Asymmetric clip range [1 - eps_low, 1 + eps_high] ("clip-higher", DAPO, Yu et al. 2025);
  PPO and GRPO use one symmetric eps. Pass eps_low == eps_high to recover them.
* The loss is returned per token, unreduced; the trainer weighs it with `loss_weights`, whose
  default is the token-mean over each mini-batch's loss-masked tokens (every token weighs the
  same, DAPO's token-level loss). The GRPO paper's seq-mean-token-mean and Dr.GRPO's constant
  normaliser are the other modes.
* No KL term here: GRPO puts k3 KL to the reference model inside the objective; we compute it
  in `kl.py` and leave adding it (to the loss or to the reward) to the caller.
* Dual clip is off unless `dual_clip` > 1 is given.

Every ratio is exp of a log-ratio clamped to [-log_ratio_clamp, log_ratio_clamp] first (default
20, as verl): a log-ratio of 90 would give exp = inf in float32 and NaN in the loss and the
gradients (0 * inf). Outside the clamp the ratio is a constant, so such a token gets no
gradient through its ratio; the clip ranges are far inside the clamp (the config requires it),
so the clamp never changes a clipped loss's value within the clip ranges.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles_core.config import AGGREGATIONS, LOG_RATIO_CLAMP


def clamped_exp(log_ratio: Tensor, log_ratio_clamp: float = LOG_RATIO_CLAMP) -> Tensor:
    """exp(clamp(log_ratio, -c, c)), elementwise: the ratio every loss and weight uses (gradient 0 where the clamp bites)."""
    return torch.exp(torch.clamp(log_ratio, -log_ratio_clamp, log_ratio_clamp))


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float = 0.0,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> tuple[Tensor, Tensor]:
    """Clipped surrogate loss per token and the clip indicator per token.

    logprobs, old_logprobs, advantages: [B, T].
    Returns (loss [B, T], clipped [B, T]); `clipped` is 1.0 where the clipped term is the
    larger (active) one and strictly differs from the unclipped one, else 0.0, so its masked
    mean is the usual clip fraction. With dual_clip = c > 1, a negative-advantage token's loss
    is at most -c * A (its ratio's pull is bounded when the ratio is huge).
    """
    ratio = clamped_exp(logprobs - old_logprobs, log_ratio_clamp)  # [B, T]
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)  # [B, T]
    loss = torch.maximum(unclipped, clipped)  # [B, T]
    clip_active = (clipped > unclipped).to(loss.dtype)  # [B, T]
    if dual_clip > 1.0:
        bound = -dual_clip * advantages  # [B, T]
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        clip_active = torch.maximum(clip_active, dual.to(loss.dtype))
    return loss, clip_active


def gspo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float, log_ratio_clamp: float = LOG_RATIO_CLAMP
) -> tuple[Tensor, Tensor]:
    """GSPO: the sequence ratio s_i = exp(mean_t (logp - old)) clipped per sequence.

    All [B, T]. Per token the ratio is sg(s_i) * exp(logp_t - sg(logp_t)): its value is s_i and
    its gradient is s_i * grad(logp_t); with the seq-mean-token-mean aggregation that is the
    paper's gradient (1/G) sum_i s_i A_i (1/|y_i|) sum_t grad(logp_t). With one-token responses
    it equals ppo_clip_loss. The sequence's mean log-ratio is clamped. Returns (loss [B, T], clipped [B, T]).
    """
    mask = mask.to(logprobs.dtype)
    log_seq_ratio = masked_mean(logprobs - old_logprobs, mask, dim=1).detach()  # [B]
    seq_ratio = clamped_exp(log_seq_ratio, log_ratio_clamp)  # [B]
    ratio = seq_ratio.unsqueeze(1) * torch.exp(logprobs - logprobs.detach())  # [B, T]
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    return loss * mask, (clipped > unclipped).to(loss.dtype) * mask


def cispo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, eps_low: float, eps_high: float, log_ratio_clamp: float = LOG_RATIO_CLAMP
) -> tuple[Tensor, Tensor]:
    """CISPO: -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * logp, per token; all [B, T].

    Returns (loss [B, T], clipped [B, T]) where `clipped` marks tokens whose weight was clipped.
    """
    ratio = clamped_exp(logprobs - old_logprobs, log_ratio_clamp).detach()  # [B, T]
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return -weight * advantages * logprobs, (weight != ratio).to(logprobs.dtype)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2); all [B, T].

    Returns (loss [B, T], clipped [B, T]) with `clipped` where the clipped term is the larger.
    """
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    plain, bounded = (values - returns) ** 2, (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(plain, bounded), (bounded > plain).to(values.dtype)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask) / max(sum(mask), 1), over `dim` or everything.

    values, mask: same shape (mask 0/1, any dtype). An all-zero mask gives 0, not NaN.
    """
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)  # []
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)  # shape minus `dim`


def loss_weights(mask: Tensor, mode: str = "token-mean", horizon: int = 1) -> Tensor:
    """Per-token weights w [B, T] such that a mini-batch's loss is sum(w * per-token loss).

    mask: [B, T] the mini-batch's loss mask; L_i = sum of row i; S = the number of rows with
    L_i > 0 (sequences that have a token in the loss); B = all rows.
    token-mean               w = mask / sum(L_i)          every token weighs the same (DAPO)
    seq-mean-token-mean      w = mask / (S * L_i)         mean per sequence, then over the S sequences (GRPO)
    seq-mean-token-sum       w = mask / S                 sum per sequence, mean over the S sequences
    seq-mean-token-sum-norm  w = mask / (B * horizon)     Dr.GRPO: sum per sequence over a constant, the
                                                          generation budget `horizon`, mean over the B rows
    A row with an empty mask gets weight 0 in every mode; the first three modes do not count it
    (verl's definitions), so a filtered-out sample does not dilute the others. Dr.GRPO's normaliser
    is a constant by design (the mini-batch size times the horizon), so it counts every row, as
    Dr.GRPO's code (mean over the batch of sum / max length); verl divides by horizon only (no 1 / B),
    a constant factor B away. An all-empty mask gives all zeros.
    """
    mask = mask.float()
    lengths = mask.sum(dim=1, keepdim=True)  # [B, 1]
    sequences = (lengths > 0).sum().clamp(min=1)  # S
    if mode == "token-mean":
        return mask / lengths.sum().clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        return mask / (sequences * lengths.clamp(min=1.0))
    if mode == "seq-mean-token-sum":
        return mask / sequences
    if mode == "seq-mean-token-sum-norm":
        return mask / (mask.shape[0] * horizon)
    raise ValueError(f"unknown loss aggregation {mode!r} (available: {', '.join(AGGREGATIONS)})")
