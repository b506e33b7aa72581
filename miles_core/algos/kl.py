"""Per-token KL estimators, entropy and token log-probabilities from logits.

The KL estimators follow Schulman's note "Approximating KL divergence" (2020): with tokens
sampled from pi and r = pi_ref / pi, k1 = -log r (unbiased, can be negative),
k2 = (log r)^2 / 2 (biased, low variance), k3 = r - 1 - log r (unbiased, >= 0). GRPO
(DeepSeekMath, Shao et al. 2024) uses k3. Departures:
* "low_var_kl" is k3 clamped as in verl: log r is clamped to [-c, c] before exp
  (c = algo.log_ratio_clamp, default 20 as verl) and the result to [-10, 10], trading
  unbiasedness on extreme tokens for bounded gradients. "k3" is accepted as another name for it.
* `old_logprobs` given (DeepSeek-V3.2, 2025) multiplies each token's estimate by the importance
  ratio pi / pi_old, correcting for tokens sampled from pi_old rather than pi. The ratio keeps
  its gradient: E_old[ratio * k] is then exactly KL(pi || pi_ref) in value and in gradient
  (with the ratio detached the k3 gradient would be that of KL(pi_ref || pi) instead). Its
  log-ratio is clamped to [-c, c] too, so log-ratios of +-100 give finite values and gradients.
* Applied per token as in GRPO. The note assumes samples from pi; rollout tokens come from
  the rollout policy, so after the first update on a batch the estimate is off-policy.
* Log-probabilities and entropy are computed in at least float32 (bf16/fp16 logits are
  upcast), with temperature applied before the softmax as the sampler does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from miles_core.algos.losses import clamped_exp
from miles_core.config import LOG_RATIO_CLAMP


def _k1(logprobs: Tensor, ref_logprobs: Tensor, log_ratio_clamp: float) -> Tensor:
    return logprobs - ref_logprobs  # [B, T]


def _k2(logprobs: Tensor, ref_logprobs: Tensor, log_ratio_clamp: float) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2  # [B, T]


def _low_var_kl(logprobs: Tensor, ref_logprobs: Tensor, log_ratio_clamp: float) -> Tensor:
    log_ratio = torch.clamp(ref_logprobs - logprobs, min=-log_ratio_clamp, max=log_ratio_clamp)  # [B, T]
    k3 = torch.exp(log_ratio) - log_ratio - 1.0  # [B, T]
    return torch.clamp(k3, min=-10.0, max=10.0)


_ESTIMATORS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "low_var_kl": _low_var_kl,
    "k3": _low_var_kl,
}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str, old_logprobs: Tensor | None = None, log_ratio_clamp: float = LOG_RATIO_CLAMP) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (or from pi_old).

    logprobs (pi), ref_logprobs (pi_ref): [B, T]. kind: "k1", "k2", "low_var_kl" ("k3").
    old_logprobs [B, T] given: the unbiased estimate, weighted by pi / pi_old (with gradient).
    Every log-ratio that is exponentiated is clamped to [-log_ratio_clamp, log_ratio_clamp]. Returns [B, T].
    """
    try:
        estimator = _ESTIMATORS[kind]
    except KeyError:
        known = ", ".join(sorted(_ESTIMATORS))
        raise ValueError(f"unknown KL estimator kind {kind!r}; known kinds: {known}") from None
    kl = estimator(logprobs, ref_logprobs, log_ratio_clamp)  # [B, T]
    if old_logprobs is not None:
        kl = kl * clamped_exp(logprobs - old_logprobs, log_ratio_clamp)
    return kl


def _upcast(logits: Tensor) -> Tensor:
    # At least float32: logsumexp over a large vocabulary in bf16 loses most of its digits.
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position: [B, T, V] -> [B, T].

    H = logsumexp(z) - sum_v p_v z_v; a -inf logit (masked vocabulary entry) adds 0, not NaN.
    """
    logits = _upcast(logits)
    log_norm = torch.logsumexp(logits, dim=-1)  # [B, T]
    probs = torch.softmax(logits, dim=-1)  # [B, T, V]
    # zero the logit where p == 0 before multiplying: 0 * -inf is NaN, in value and in gradient
    finite_logits = logits.masked_fill(probs == 0, 0.0)  # [B, T, V]
    return log_norm - (probs * finite_logits).sum(dim=-1)  # [B, T]


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) at the given tokens: [B, T, V] x [B, T] -> [B, T].

    Gathers the chosen logit and subtracts the logsumexp, so no [B, T, V] log-softmax is built.
    `tokens` must be valid vocabulary ids (replace padding ids before calling).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = _upcast(logits)
    if temperature != 1.0:
        logits = logits / temperature  # [B, T, V]
    chosen = torch.gather(logits, -1, tokens.long().unsqueeze(-1)).squeeze(-1)  # [B, T]
    return chosen - torch.logsumexp(logits, dim=-1)  # [B, T]
