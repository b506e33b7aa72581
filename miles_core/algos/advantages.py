"""Advantage estimators: GRPO, RLOO, REINFORCE++ (and its group baseline), PPO's GAE.

* grpo (DeepSeekMath, Shao et al. 2024): reward minus group mean, over the group std; with
  `normalize_std=False` it is Dr.GRPO's (Liu et al. 2025) centering only. GSPO (Zheng et al.
  2025) uses the same group-normalised advantage; it differs in the loss (`losses.gspo_loss`).
* rloo (Ahmadian et al. 2024): reward minus the mean of the *other* samples of its group.
* reinforce_plus_plus (Hu 2025): per-token rewards (outcome at the last token, minus the KL
  penalty on every token when KL is shaped into the reward), discounted returns, whitened over
  the whole batch. reinforce_plus_plus_baseline subtracts the group mean reward first.
* ppo (Schulman et al. 2017) with GAE (Schulman et al. 2016) on a learned critic's values;
  advantages whitened over the batch, returns = advantages + values (before whitening).

Departures from the GRPO paper:
* The paper writes "std(r)" without saying which estimator. We use the unbiased (Bessel,
  n - 1) std, as the reference GRPO implementations do (`Tensor.std()` in TRL and verl), so
  numbers match theirs. A group of size 1 has no spread: its std is taken as 0.
* `eps` is added to the std rather than guarding the division, so a group whose rewards are
  all equal gets advantage 0 (0 / eps) instead of NaN.
* `normalize_std=False` drops the division entirely (centering only), the variant Dr. GRPO
  (Liu et al. 2025) argues for; the paper always divides.
* Only outcome rewards (one scalar per sample); the paper's process-supervision variant is
  not implemented. The per-token advantage is the sample's advantage on every response
  token, as in the paper.

Groups of one sample (group_size 1), the same rule everywhere: a group baseline of one sample is
the sample itself.
* grpo and reinforce_plus_plus_baseline: reward minus its group mean is 0, so the sample's
  outcome advantage is 0 (it teaches nothing; reinforce_plus_plus_baseline keeps its KL shaping).
  verl instead takes mean 0 / std 1 for a group of one (the raw reward); we keep the definition.
* rloo: the leave-one-out mean of no other sample is undefined: ValueError (and the config
  refuses algo.advantage rloo with rollout.n_samples < 2 at load).
* reinforce_plus_plus and ppo take no groups; group_size is not read.

Masks: token-level estimators (discounted returns, GAE) run over the *valid* positions of each
row only. A masked position inside a response (a hole: e.g. a tool's output in a multi-turn
sample, which the policy did not generate) is skipped as verl's multi-turn GAE does: it is not
a step (no discount, no reward, no value), the recursion passes through it unchanged, and its
advantage and return are 0. So a row with holes gets exactly the values of the same row with
the holes removed. Rows need not be right-padded.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """rewards [B] (floating) as [B/G, G]; entries [k*G, (k+1)*G) form group k."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.shape[0] % group_size != 0:
        raise ValueError(f"batch size {rewards.shape[0]} is not a multiple of group_size {group_size}: each prompt must contribute exactly group_size samples")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    return rewards.reshape(-1, group_size)  # [B/G, G]


def grpo_advantages(rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Reward minus its group's mean, over (group std + eps) when `normalize_std`.

    rewards: [B], B a multiple of `group_size`; entries [k*G, (k+1)*G) form group k.
    A group of one gets advantage 0 (its mean is its reward). Returns [B] (floating).
    """
    grouped = _grouped(rewards, group_size)  # [B/G, G]
    batch = rewards.shape[0]
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # [B/G, G]
    if normalize_std:
        if group_size > 1:
            std = grouped.std(dim=1, correction=1, keepdim=True)  # [B/G, 1]
        else:
            std = grouped.new_zeros(grouped.shape[0], 1)  # [B/G, 1]
        centered = centered / (std + eps)
    return centered.reshape(batch)  # [B]


def broadcast_to_tokens(adv: Tensor, mask: Tensor) -> Tensor:
    """Each sample's advantage on each of its unmasked tokens: [B] x [B, T] -> [B, T]."""
    if adv.dim() != 1 or mask.dim() != 2 or adv.shape[0] != mask.shape[0]:
        raise ValueError(f"expected adv [B] and mask [B, T], got {tuple(adv.shape)} and {tuple(mask.shape)}")
    return adv.unsqueeze(1) * mask.to(adv.dtype)  # [B, T]


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Leave-one-out baseline: r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_j r_j).

    rewards: [B], consecutive groups of `group_size` >= 2 (with one sample there is no other
    sample to average: ValueError). Returns [B].
    """
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2 (the baseline is the mean of the other samples of the group), got {group_size}")
    grouped = _grouped(rewards, group_size)  # [B/G, G]
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # [B/G, G]
    return (grouped - others).reshape(-1)  # [B]


def token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """The outcome reward on each response's last token, minus kl_coef * kl on every token.

    rewards: [B]; mask: [B, T] response tokens (right-padded); kl: [B, T] or None. Returns [B, T].
    """
    mask = mask.float()
    out = torch.zeros_like(mask)  # [B, T]
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = (positions * (mask > 0)).max(dim=1).values  # [B] index of each row's last token
    out[torch.arange(mask.shape[0]), last] = rewards.float() * (mask.sum(dim=1) > 0)
    if kl is not None and kl_coef > 0:
        out = out - kl_coef * kl * mask
    return out


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = r_t + gamma G_t' at each valid position t, t' the next valid one (G = 0 after the last);
    masked positions are skipped (no step, reward ignored) and get 0. [B, T] -> [B, T]."""
    valid = mask > 0  # [B, T]
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, 0.0)
    return returns


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(v - mean) / std over the masked entries of the whole batch (unbiased std); 0 off the mask."""
    valid = mask > 0
    values = torch.where(valid, values, 0.0)  # whatever sits off the mask (even NaN) stays out
    count = valid.sum().clamp(min=1).to(values.dtype)
    mean = values.sum() / count
    var = torch.where(valid, values - mean, 0.0).pow(2).sum() / (count - 1).clamp(min=1.0)
    return torch.where(valid, (values - mean) * torch.rsqrt(var + eps), 0.0)


def reinforce_plus_plus_advantages(rewards: Tensor, mask: Tensor, gamma: float = 1.0, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Whitened discounted returns of the per-token rewards. rewards [B]; mask, kl [B, T]. -> [B, T]."""
    return whiten(discounted_returns(token_rewards(rewards, mask, kl, kl_coef), mask, gamma), mask)


def reinforce_plus_plus_baseline_advantages(
    rewards: Tensor, group_size: int, mask: Tensor, gamma: float = 1.0, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """REINFORCE++ on rewards minus their group mean (the group baseline), then whitened. -> [B, T]."""
    centered = grpo_advantages(rewards, group_size, normalize_std=False)  # [B]
    return reinforce_plus_plus_advantages(centered, mask, gamma, kl, kl_coef)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the valid positions of each row.

    rewards (per token), values (critic, V(s_t) before token t), mask: [B, T]. With t' the next
    valid position after t: delta_t = r_t + gamma V(s_t') - V(s_t), V = 0 after the last valid
    position; A_t = delta_t + gamma lam A_t'. Masked positions are skipped (the recursion passes
    through them) and get A = 0 and return 0. Returns (advantages [B, T], returns = A + V [B, T]).
    """
    valid = mask > 0  # [B, T]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)  # A at the next valid position
    next_value = torch.zeros(rewards.shape[0], dtype=rewards.dtype)  # V at the next valid position
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(valid[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(valid[:, t], running, 0.0)
    return advantages, torch.where(valid, advantages + values, 0.0)
