"""The RL training objective per token: PPO-clip on GRPO advantages, plus optional KL and entropy terms.

`policy_loss` has the trainer's LossFn signature; `extras` carries the per-token tensors that the
step computed before training: old log-probs, advantages and (when kl_coef > 0) reference
log-probs, each [b, T].
"""

from __future__ import annotations

import torch

from miles_core.algos.kl import kl_penalty
from miles_core.algos.losses import ppo_clip_loss
from miles_core.config import AlgoConfig


def policy_loss(algo: AlgoConfig, logprobs: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, extras: dict) -> tuple[torch.Tensor, dict]:
    loss, clipped = ppo_clip_loss(logprobs, extras["old_logprobs"], extras["advantages"], algo.eps_clip_low, algo.eps_clip_high)  # [b, T]
    metrics = {"clip_fraction": clipped, "ratio": torch.exp(logprobs - extras["old_logprobs"]).detach()}
    if algo.kl_coef > 0:
        kl = kl_penalty(logprobs, extras["ref_logprobs"], algo.kl_type)  # [b, T]
        loss = loss + algo.kl_coef * kl
        metrics["kl"] = kl.detach()
    if algo.entropy_coef > 0:
        loss = loss - algo.entropy_coef * entropy
    return loss, metrics


def sft_loss(logprobs: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, extras: dict) -> tuple[torch.Tensor, dict]:
    """Cross-entropy on the loss-masked tokens (the trainer takes the token-mean)."""
    return -logprobs, {}
