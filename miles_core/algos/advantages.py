"""Group-relative advantages (GRPO, DeepSeekMath, Shao et al. 2024, outcome supervision).

Departures from the paper:
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
"""

from __future__ import annotations

from torch import Tensor


def grpo_advantages(
    rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Reward minus its group's mean, over (group std + eps) when `normalize_std`.

    rewards: [B], B a multiple of `group_size`; entries [k*G, (k+1)*G) form group k.
    Returns [B] in the dtype of `rewards` (floating).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    batch = rewards.shape[0]
    if batch % group_size != 0:
        raise ValueError(
            f"batch size {batch} is not a multiple of group_size {group_size}: "
            "each prompt must contribute exactly group_size samples"
        )
    if not rewards.is_floating_point():
        rewards = rewards.float()
    grouped = rewards.reshape(-1, group_size)  # [B/G, G]
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
        raise ValueError(
            f"expected adv [B] and mask [B, T], got {tuple(adv.shape)} and {tuple(mask.shape)}"
        )
    return adv.unsqueeze(1) * mask.to(adv.dtype)  # [B, T]
