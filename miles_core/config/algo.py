"""algo: advantages, the policy loss, KL, importance corrections."""

from __future__ import annotations

import math
from dataclasses import dataclass

from miles_core.config.base import check as _check
from miles_core.config.base import check_finite

ADVANTAGES = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
POLICY_LOSSES = ("ppo", "gspo", "cispo")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOG_RATIO_CLAMP = 20.0  # verl's bound on a log-ratio before exp: exp(20) ~ 4.9e8 stays finite in float32
MISMATCH_THRESHOLD = 0.1  # |train - rollout log-prob| above it: the token's probability differs by more than ~10% (e^0.1 = 1.105)


@dataclass(frozen=True)
class AlgoConfig:
    advantage: str = "grpo"  # grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | ppo (GAE + critic)
    normalize_std: bool = True  # grpo: divide by the group std (False = Dr.GRPO)
    policy_loss: str = "ppo"  # ppo (token clip) | gspo (sequence ratio) | cispo
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    dual_clip: float = 0.0  # > 1 bounds negative-advantage tokens' loss at -c * A; 0 = off
    log_ratio_clamp: float = LOG_RATIO_CLAMP  # every log-ratio (PPO/GSPO/CISPO ratios, KL, IS weights) is clamped to +-this before exp
    loss_aggregation: str = "token-mean"
    aggregation_horizon: int = 0  # seq-mean-token-sum-norm's constant; 0 = rollout.max_new_tokens
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    kl_unbiased: bool = False  # weight the KL estimate by pi / pi_old (DeepSeek-V3.2)
    kl_in_reward: bool = False  # shape the reward with -kl_coef * KL instead of a KL loss
    entropy_coef: float = 0.0
    gamma: float = 1.0  # discount of token-level returns (reinforce_plus_plus, ppo)
    lam: float = 0.95  # GAE lambda
    value_clip: float = 0.2
    critic_lr: float = 1e-3
    critic_warmup_steps: int = 0  # first iterations train the critic only
    use_rollout_logprobs: bool = False  # old policy = the rollout's log-probs instead of a recompute
    is_correction: str = "none"  # none | tis | mis: train/inference mismatch importance weights
    is_level: str = "token"  # token | sequence
    is_lower: float = 0.5
    is_upper: float = 2.0
    mismatch_threshold: float = MISMATCH_THRESHOLD  # mismatch/beyond_threshold_fraction counts tokens with |train - rollout log-prob| above this
    advantage_fn: str = "miles_core.algos.objective:compute_advantages"  # plug-point
    loss_fn: str = "miles_core.algos.objective:policy_loss"  # plug-point
    is_correction_fn: str = "miles_core.algos.objective:is_weights"  # plug-point
    sample_filter_fn: str = "miles_core.algos.filters:keep_all"  # plug-point: keep(sample) -> bool

    def __post_init__(self):
        check_finite(self, "algo")
        _check(self.advantage in ADVANTAGES, "algo.advantage", f"unknown estimator {self.advantage!r} (available: {', '.join(ADVANTAGES)})")
        _check(self.policy_loss in POLICY_LOSSES, "algo.policy_loss", f"unknown loss {self.policy_loss!r} (available: {', '.join(POLICY_LOSSES)})")
        _check(self.loss_aggregation in AGGREGATIONS, "algo.loss_aggregation", f"unknown mode {self.loss_aggregation!r} (available: {', '.join(AGGREGATIONS)})")
        _check(
            0 < self.eps_clip_low < 1,
            "algo.eps_clip_low",
            f"must be in (0, 1) (the ratio's lower bound 1 - eps_clip_low is in (0, 1)), got {self.eps_clip_low}",
        )
        _check(self.eps_clip_high > 0, "algo.eps_clip_high", f"must be > 0, got {self.eps_clip_high}")
        _check(self.dual_clip == 0 or self.dual_clip > 1, "algo.dual_clip", "must be 0 (off) or > 1")
        _check(self.aggregation_horizon >= 0, "algo.aggregation_horizon", "must be >= 0")
        _check(self.kl_coef >= 0, "algo.kl_coef", "must be >= 0")
        _check(self.entropy_coef >= 0, "algo.entropy_coef", f"must be >= 0 (an entropy bonus), got {self.entropy_coef}")
        _check(self.kl_type in KL_TYPES, "algo.kl_type", f"unknown KL estimator {self.kl_type!r} (available: {', '.join(KL_TYPES)})")
        _check(0 < self.gamma <= 1, "algo.gamma", f"must be in (0, 1], got {self.gamma}")
        _check(0 <= self.lam <= 1, "algo.lam", f"must be in [0, 1], got {self.lam}")
        _check(self.value_clip > 0, "algo.value_clip", f"must be > 0, got {self.value_clip}")
        _check(self.critic_lr > 0, "algo.critic_lr", f"must be > 0, got {self.critic_lr}")
        _check(self.critic_warmup_steps >= 0, "algo.critic_warmup_steps", "must be >= 0")
        _check(self.is_correction in ("none", "tis", "mis"), "algo.is_correction", f"unknown correction {self.is_correction!r} (available: none, tis, mis)")
        _check(self.is_level in ("token", "sequence"), "algo.is_level", f"must be token or sequence, got {self.is_level!r}")
        _check(0 <= self.is_lower < 1 < self.is_upper, "algo.is_upper", "need 0 <= is_lower < 1 < is_upper")
        _check(self.mismatch_threshold > 0, "algo.mismatch_threshold", f"must be > 0 (a log-prob difference), got {self.mismatch_threshold}")
        self._check_log_ratio_clamp()

    def _check_log_ratio_clamp(self):
        # the clamp must sit outside every bound applied to a ratio, or it would move that bound
        c = self.log_ratio_clamp
        _check(c > 0, "algo.log_ratio_clamp", f"must be > 0, got {c}")
        bounds = {"1 + algo.eps_clip_high": 1 + self.eps_clip_high, "algo.is_upper": self.is_upper, "algo.dual_clip": self.dual_clip or 1.0}
        for name, bound in bounds.items():
            _check(math.log(bound) < c, "algo.log_ratio_clamp", f"must be > log({name}) = {math.log(bound):.4g}, or the clamp changes that bound")
        lows = {"1 - algo.eps_clip_low": 1 - self.eps_clip_low, "algo.is_lower": self.is_lower}
        for name, bound in lows.items():
            _check(
                bound == 0 or math.log(bound) > -c, "algo.log_ratio_clamp", f"must be > -log({name}) = {-math.log(bound):.4g}, or the clamp changes that bound"
            )
