"""The RL objective as the config chooses it: advantages, the policy and value losses, IS weights.

These are the defaults of the `algo.advantage_fn`, `algo.loss_fn` and `algo.is_correction_fn`
plug-points; each dispatches on AlgoConfig to the pure functions of advantages.py, losses.py,
kl.py and corrections.py. Loss functions have the trainer's LossFn signature (after `algo`);
`extras` carries per-token tensors [b, T] computed before training: old_logprobs, advantages,
and optionally ref_logprobs, is_weights (policy) or old_values, returns (critic).
"""

from __future__ import annotations

from torch import Tensor

from miles_core.algos import advantages as adv
from miles_core.algos.corrections import importance_weights
from miles_core.algos.kl import kl_penalty
from miles_core.algos.losses import (
    cispo_loss,
    clamped_exp,
    gspo_loss,
    ppo_clip_loss,
    value_loss,
)
from miles_core.config import AlgoConfig


def compute_advantages(
    algo: AlgoConfig, rewards: Tensor, mask: Tensor, group_size: int, kl: Tensor | None, values: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Plug-point `algo.advantage_fn(algo, rewards, mask, group_size, kl, values) -> (advantages, returns)`.

    rewards [B] (groups of group_size consecutive samples); mask [B, T] response tokens;
    kl [B, T] per-token KL to the reference when algo.kl_in_reward, else None; values [B, T]
    the critic's when algo.advantage == "ppo", else None. Returns advantages [B, T] and the
    critic's regression targets [B, T] (None without a critic).
    Groups of one: grpo and reinforce_plus_plus_baseline give outcome advantage 0, rloo raises
    ValueError, reinforce_plus_plus and ppo read no groups. Token-level estimators (ppo,
    reinforce_plus_plus*) skip masked positions inside a row (see advantages.py): pass the loss
    mask to skip tool outputs, the response mask to treat them as steps.
    """
    shaped = algo.kl_coef if algo.kl_in_reward else 0.0
    if algo.advantage == "ppo":
        advantages, returns = adv.gae(adv.token_rewards(rewards, mask, kl, shaped), values, mask, algo.gamma, algo.lam)
        return adv.whiten(advantages, mask), returns
    if algo.advantage == "reinforce_plus_plus":
        return adv.reinforce_plus_plus_advantages(rewards, mask, algo.gamma, kl, shaped), None
    if algo.advantage == "reinforce_plus_plus_baseline":
        return adv.reinforce_plus_plus_baseline_advantages(rewards, group_size, mask, algo.gamma, kl, shaped), None
    if kl is not None and shaped:  # outcome-level estimators: the sequence's summed KL penalty
        rewards = rewards - shaped * (kl * mask).sum(dim=1)
    if algo.advantage == "rloo":
        return adv.broadcast_to_tokens(adv.rloo_advantages(rewards, group_size), mask), None
    return adv.broadcast_to_tokens(adv.grpo_advantages(rewards, group_size, algo.normalize_std), mask), None


def policy_loss(algo: AlgoConfig, logprobs: Tensor, entropy: Tensor, mask: Tensor, extras: dict) -> tuple[Tensor, dict]:
    """Plug-point `algo.loss_fn(algo, logprobs, entropy, mask, extras) -> (loss [b, T], metrics)`."""
    old, advantages = extras["old_logprobs"], extras["advantages"]
    if algo.policy_loss == "gspo":
        loss, clipped = gspo_loss(logprobs, old, advantages, mask, algo.eps_clip_low, algo.eps_clip_high, algo.log_ratio_clamp)
    elif algo.policy_loss == "cispo":
        loss, clipped = cispo_loss(logprobs, old, advantages, algo.eps_clip_low, algo.eps_clip_high, algo.log_ratio_clamp)
    else:
        loss, clipped = ppo_clip_loss(logprobs, old, advantages, algo.eps_clip_low, algo.eps_clip_high, algo.dual_clip, algo.log_ratio_clamp)
    if "is_weights" in extras:
        loss = loss * extras["is_weights"]
    metrics = {"clip_fraction": clipped, "ratio": clamped_exp(logprobs - old, algo.log_ratio_clamp).detach()}
    if algo.kl_coef > 0 and not algo.kl_in_reward:
        kl = kl_penalty(logprobs, extras["ref_logprobs"], algo.kl_type, old if algo.kl_unbiased else None, algo.log_ratio_clamp)  # [b, T]
        loss = loss + algo.kl_coef * kl
        metrics["kl"] = kl.detach()
    if algo.entropy_coef > 0:
        loss = loss - algo.entropy_coef * entropy
    return loss, metrics


def critic_loss(algo: AlgoConfig, values: Tensor, entropy: Tensor, mask: Tensor, extras: dict) -> tuple[Tensor, dict]:
    """The critic's LossFn: PPO's clipped value loss against the GAE returns."""
    loss, clipped = value_loss(values, extras["old_values"], extras["returns"], algo.value_clip)
    return loss, {"value_clip_fraction": clipped, "value": values.detach()}


def is_weights(algo: AlgoConfig, train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, dict]:
    """Plug-point `algo.is_correction_fn(algo, train_logprobs, rollout_logprobs, mask) -> (weights [B, T], metrics)`.

    Called only when algo.is_correction != "none"; weights multiply the per-token policy loss.
    """
    settings = (algo.is_correction, algo.is_level, algo.is_lower, algo.is_upper, algo.log_ratio_clamp, algo.mismatch_threshold)
    return importance_weights(train_logprobs, rollout_logprobs, mask, *settings)


def sft_loss(logprobs: Tensor, entropy: Tensor, mask: Tensor, extras: dict) -> tuple[Tensor, dict]:
    """Cross-entropy on the loss-masked tokens (aggregated by the trainer's weights function)."""
    return -logprobs, {}
