"""On-policy distillation: a teacher scores the student's sampled tokens; the reverse KL trains the student.

The student pi_s (the policy) samples y ~ pi_s(. | x); the teacher pi_t gives the log-prob of each sampled token
(its own task, miles_core/distill.py). On a sampled token the per-token reverse KL estimate is

    k_t = log pi_s(y_t | x, y_<t) - log pi_t(y_t | x, y_<t)        (kl.py's k1 with the teacher as reference)

whose expectation over y_t ~ pi_s is KL(pi_s || pi_t) at position t: positive where the student puts more mass on its
token than the teacher does. `distill.mode` trains on it in one of two ways:

* kl: A_t = -coef * k_t is token t's advantage, with no credit to earlier tokens (discount 0): Thinking Machines'
  on-policy distillation and Miles' OPD (TRL's GKD with lmbda = 1, beta = 1 takes the same reverse KL over the whole
  vocabulary at each position; here it is estimated on the sampled token). The policy loss -A_t * ratio_t
  then has, at ratio 1, the gradient coef * k_t * grad log pi_s(y_t), whose expectation over y_t is coef times the
  gradient of KL(pi_s || pi_t) at position t (E[grad log pi_s] = 0): minimising the loss descends the reverse KL.
* reward: r_t = -coef * k_t = coef * (log pi_t(y_t) - log pi_s(y_t)) is a dense per-token reward (the teacher's
  log-prob plus the student's surprisal) and its discounted return G_t = sum_{t' >= t} gamma^(t' - t) r_t' is the
  advantage (MiniLLM's policy gradient). With gamma = 1 its expectation is the gradient of the sequence-level reverse
  KL: a token also pays for the divergence of the continuation it leads to.

Either is computed from the student's log-probs before the step's update (the PPO ratio's old_logprobs: no gradient
flows through the advantage), at the rollout's temperature like the teacher's, and is added to the task reward's
advantage (algo.advantage, already normalised) when `distill.with_reward`, else it is the whole advantage. Departures:
the distillation term is not normalised with the task reward's (its scale is coef's to set); tokens outside the loss
mask (a tool's output) get 0 and are skipped by the returns, as advantages.py skips them.
"""

from __future__ import annotations

from torch import Tensor

from miles_core.algos.advantages import discounted_returns
from miles_core.algos.losses import masked_mean
from miles_core.config import DistillConfig


def reverse_kl(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """k_t = log pi_s(y_t) - log pi_t(y_t) on the loss-masked tokens, 0 elsewhere. All [B, T]."""
    return (student_logprobs - teacher_logprobs) * mask.to(student_logprobs.dtype)


def distill_advantages(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, mode: str, coef: float, gamma: float = 1.0) -> Tensor:
    """The distillation term of each token's advantage [B, T]: -coef * k_t (mode kl), or the discounted return of the
    dense reward -coef * k_t (mode reward). student_logprobs, teacher_logprobs, mask: [B, T]."""
    reward = -coef * reverse_kl(student_logprobs, teacher_logprobs, mask)  # [B, T]
    if mode == "kl":
        return reward
    if mode == "reward":
        return discounted_returns(reward, mask, gamma)
    raise ValueError(f"unknown distillation mode {mode!r} (available: kl, reward)")


def with_teacher(
    cfg: DistillConfig, advantages: Tensor, student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, gamma: float = 1.0
) -> tuple[Tensor, dict[str, float]]:
    """The step's advantages [B, T] under distillation: the distillation term, plus the task reward's `advantages` [B, T]
    when cfg.with_reward; and the batch's mean reverse KL, teacher log-prob and distillation advantage per token.
    teacher_logprobs None (a batch the teacher did not score) is refused."""
    if teacher_logprobs is None:
        raise ValueError("distill.teacher is set, but the batch carries no teacher log-probs: score it with the teacher first (miles_core.distill)")
    distilled = distill_advantages(student_logprobs, teacher_logprobs, mask, cfg.mode, cfg.coef, gamma)  # [B, T]
    metrics = {
        "distill/reverse_kl": float(masked_mean(reverse_kl(student_logprobs, teacher_logprobs, mask), mask)),
        "distill/teacher_logprob": float(masked_mean(teacher_logprobs, mask)),
        "distill/advantage": float(masked_mean(distilled, mask)),
    }
    return (advantages + distilled if cfg.with_reward else distilled), metrics
