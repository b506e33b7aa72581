"""Train/inference mismatch: importance weights between the trainer's and the rollout's policy.

The rollout engine and the trainer compute slightly different log-probs for the same tokens
(kernels, precision, batching). When the trainer's recomputed log-probs are the old policy,
the tokens were still sampled from the rollout policy; weighting each token by
w = pi_train_old / pi_rollout corrects for it (Yao et al. 2025, "Your efficient RL framework
secretly brings you off-policy RL training"). Two ways to bound the weight:
* tis (truncated IS): w <- min(w, upper).
* mis (masked IS, Liu et al. 2025 "When speed kills stability"): tokens (or whole sequences)
  with w outside [lower, upper] get weight 0; the rest keep weight w.
`level="sequence"` uses the sequence weight exp(sum_t log w_t) for every token of the sequence.
Departures: weights are computed once per batch (no gradient), before training, from the
trainer's log-probs at the start of the step. The log-weight (per token, or the sequence's sum)
is clamped to [-log_ratio_clamp, log_ratio_clamp] before exp (default 20, as verl), so extreme
mismatches give finite weights and metrics; with is_upper < exp(clamp) (the config requires it)
the clamp does not change a bounded weight.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles_core.algos.losses import clamped_exp, masked_mean
from miles_core.config import LOG_RATIO_CLAMP, MISMATCH_THRESHOLD


def mismatch_metrics(
    train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, log_ratio_clamp: float = LOG_RATIO_CLAMP, threshold: float = MISMATCH_THRESHOLD
) -> dict[str, float]:
    """|delta log-prob|, KL(rollout || train) (k3, sampled from the rollout), the effective-sample-size
    ratio (sum w)^2 / (N sum w^2) of the token weights and the fraction of tokens whose |delta log-prob|
    exceeds `threshold` (algo.mismatch_threshold); inputs [B, T].
    The log-weights are clamped before exp, as in the weights themselves."""
    raw_log_w = (train_logprobs - rollout_logprobs).detach() * mask  # [B, T]
    log_w = torch.clamp(raw_log_w, -log_ratio_clamp, log_ratio_clamp)  # [B, T]
    w = torch.exp(log_w)
    n = mask.sum().clamp(min=1.0)
    w_sum, w_sq = (w * mask).sum(), (w * w * mask).sum()
    return {
        "mismatch/abs_logprob_diff": float(masked_mean(raw_log_w.abs(), mask)),
        "mismatch/kl_rollout_train": float(masked_mean(w - 1.0 - log_w, mask)),
        "mismatch/ess_ratio": float(w_sum * w_sum / (n * w_sq.clamp(min=1e-12))),
        "mismatch/beyond_threshold_fraction": float(masked_mean((raw_log_w.abs() > threshold).float(), mask)),
    }


def importance_weights(
    train_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    mode: str,
    level: str,
    lower: float,
    upper: float,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    mismatch_threshold: float = MISMATCH_THRESHOLD,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token IS weights [B, T] (no gradient) and metrics; inputs [B, T].

    mode "tis" | "mis"; level "token" | "sequence"; the weight is bounded to [lower, upper]
    (tis truncates only above, as in the paper; mis zeroes what falls outside).
    """
    mask = mask.float()
    log_w = (train_logprobs - rollout_logprobs).detach() * mask  # [B, T]
    if level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(mask)  # [B, T]: the sequence's weight on each token
    elif level != "token":
        raise ValueError(f"unknown importance-sampling level {level!r} (available: token, sequence)")
    w = clamped_exp(log_w, log_ratio_clamp)  # [B, T]
    if mode == "tis":
        bounded = torch.clamp(w, max=upper)
        changed = w > upper
    elif mode == "mis":
        changed = (w < lower) | (w > upper)
        bounded = torch.where(changed, torch.zeros_like(w), w)
    else:
        raise ValueError(f"unknown importance-sampling mode {mode!r} (available: tis, mis)")
    metrics = mismatch_metrics(train_logprobs, rollout_logprobs, mask, log_ratio_clamp, mismatch_threshold)
    metrics[f"mismatch/{mode}_{'clipped' if mode == 'tis' else 'masked'}_fraction"] = float(masked_mean(changed.float(), mask))
    metrics["mismatch/is_weight_mean"] = float(masked_mean(bounded, mask))
    return bounded * mask, metrics
