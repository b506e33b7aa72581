"""Advantages, losses and KL estimators: hand-derived numbers and properties; the numerics at the edges
(log-ratio clamp, holes in a response mask, groups of one)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_core.algos.advantages import (
    broadcast_to_tokens,
    discounted_returns,
    gae,
    grpo_advantages,
)
from miles_core.algos.corrections import importance_weights
from miles_core.algos.kl import entropy_from_logits, kl_penalty, token_logprobs
from miles_core.algos.losses import masked_mean, ppo_clip_loss
from miles_core.algos.objective import compute_advantages, is_weights, policy_loss
from miles_core.config import AlgoConfig

# Behaviour only: no per-example deadline, few examples so the file stays fast.
PROPERTY = settings(max_examples=30, deadline=None, derandomize=True, database=None)
# softmax-based checks: CPU softmax dispatches to the thread pool even for tiny tensors
FEW = settings(PROPERTY, max_examples=15)

finite = st.floats(min_value=-5.0, max_value=5.0, allow_nan=False, allow_infinity=False)


def close(actual: torch.Tensor, expected, atol: float = 1e-4) -> None:
    # plain allclose: torch.testing pulls in half a second of imports
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.allclose(actual, expected, rtol=0, atol=atol), f"{actual} vs {expected}"


# --------------------------------------------------------------------------- advantages


def test_grpo_advantages_by_hand():
    # group [1, 0, 0, 1]: mean 0.5, deviations ±0.5, sum of squares 4 * 0.25 = 1,
    #   unbiased var 1 / (4 - 1) = 1/3, std sqrt(1/3) = 0.57735 -> adv ±0.5 / 0.57735 = ±0.8660
    # group [2, 2, 2, 2]: all equal, std 0 -> 0 / (0 + eps) = 0, not NaN
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = grpo_advantages(rewards, group_size=4)
    close(adv, [0.8660, -0.8660, -0.8660, 0.8660, 0.0, 0.0, 0.0, 0.0])


def test_grpo_advantages_group_of_two_and_centering_only():
    # group [3, 1]: mean 2, deviations ±1, unbiased var (1 + 1) / (2 - 1) = 2,
    #   std sqrt(2) = 1.41421 -> adv ±1 / 1.41421 = ±0.7071
    # (population std would be 1 and give ±1: this pins the unbiased choice)
    close(grpo_advantages(torch.tensor([3.0, 1.0]), group_size=2), [0.7071, -0.7071])
    # normalize_std=False: [1, 0, 0, 1] - 0.5 = [0.5, -0.5, -0.5, 0.5]
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, normalize_std=False)
    close(adv, [0.5, -0.5, -0.5, 0.5])


def test_grpo_advantages_integer_rewards_and_group_of_one():
    # int rewards are promoted to float; [1, 0] -> ±0.5 / sqrt(0.5) = ±0.7071
    close(grpo_advantages(torch.tensor([1, 0]), group_size=2), [0.7071, -0.7071])
    # group_size 1: each sample is its own group, reward - itself = 0, no NaN
    adv = grpo_advantages(torch.tensor([5.0, -3.0]), group_size=1)
    close(adv, [0.0, 0.0])


def test_grpo_advantages_rejects_ragged_batch():
    with pytest.raises(ValueError, match="5 is not a multiple of group_size 2"):
        grpo_advantages(torch.zeros(5), group_size=2)


@PROPERTY
@given(
    group_size=st.integers(min_value=1, max_value=6),
    data=st.data(),
    normalize_std=st.booleans(),
)
def test_grpo_advantages_sum_to_zero_per_group(group_size, data, normalize_std):
    groups = data.draw(st.integers(min_value=1, max_value=4))
    values = data.draw(st.lists(finite, min_size=groups * group_size, max_size=groups * group_size))
    rewards = torch.tensor(values, dtype=torch.float64)
    adv = grpo_advantages(rewards, group_size, normalize_std=normalize_std)
    assert torch.isfinite(adv).all()
    # |adv| <= (G - 1) / sqrt(G) after normalising, so 1e-6 absolute is generous in float64
    close(adv.view(groups, group_size).sum(dim=1), torch.zeros(groups), atol=1e-6)


def test_broadcast_to_tokens_by_hand():
    # adv [2, -1] times mask rows [1, 1, 0] and [1, 0, 0]
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    close(broadcast_to_tokens(adv, mask), [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])


# --------------------------------------------------------------------------- losses


def test_ppo_clip_loss_by_hand():
    # eps_low 0.2, eps_high 0.28 -> clip range [0.8, 1.28]
    #   A= 1, r=1.5: unclipped -1.5, clipped -1.28, max -1.28, clipped active   -> 1
    #   A= 1, r=0.5: unclipped -0.5, clipped -0.8,  max -0.5,  unclipped active -> 0
    #   A=-1, r=0.5: unclipped  0.5, clipped  0.8,  max  0.8,  clipped active   -> 1
    #   A=-1, r=1.5: unclipped  1.5, clipped  1.28, max  1.5,  unclipped active -> 0
    #   A= 2, r=1.1: inside the range, -2 * 1.1 = -2.2                          -> 0
    #   A= 0, r=1.5: both terms 0, equal so not counted                         -> 0
    ratio = torch.tensor([[1.5, 0.5, 0.5], [1.5, 1.1, 1.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 2.0, 0.0]])
    old = torch.full_like(ratio, -0.7)
    loss, clipped = ppo_clip_loss(old + ratio.log(), old, adv, eps_low=0.2, eps_high=0.28)
    close(loss, [[-1.28, -0.5, 0.8], [1.5, -2.2, 0.0]])
    close(clipped, [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]], atol=0)


def _bt(values, batch=2):
    return torch.tensor(values, dtype=torch.float64).view(batch, -1)


token_lists = st.lists(st.tuples(finite, finite, finite), min_size=2, max_size=8).filter(lambda rows: len(rows) % 2 == 0)
eps_range = st.floats(min_value=0.0, max_value=0.5)


@PROPERTY
@given(rows=token_lists, eps_low=eps_range, eps_high=eps_range)
def test_clipped_objective_never_exceeds_unclipped(rows, eps_low, eps_high):
    logprobs, old, adv = (_bt(column) for column in zip(*rows))
    loss, _ = ppo_clip_loss(logprobs, old, adv, eps_low, eps_high)
    ratio = torch.exp(logprobs - old)
    # pessimistic bound: objective -loss = min(A r, A clip(r)) <= A r
    assert (-loss <= adv * ratio + 1e-9).all()


@PROPERTY
@given(rows=token_lists, eps_low=eps_range, eps_high=eps_range)
def test_ratio_one_gives_minus_advantage_and_no_clipping(rows, eps_low, eps_high):
    logprobs, _, adv = (_bt(column) for column in zip(*rows))
    loss, clipped = ppo_clip_loss(logprobs, logprobs.clone(), adv, eps_low, eps_high)
    close(loss, -adv, atol=1e-12)
    assert clipped.sum() == 0


def test_masked_mean_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # all: (1 + 2 + 4) / 3 = 2.3333
    close(masked_mean(values, mask), 7.0 / 3.0)
    # per row: (1 + 2) / 2 = 1.5 and 4 / 1 = 4
    close(masked_mean(values, mask, dim=1), [1.5, 4.0])
    # a fully masked row: 0 / max(0, 1) = 0
    close(masked_mean(values, torch.tensor([[1, 1, 1], [0, 0, 0]]), dim=1), [2.0, 0.0])


@PROPERTY
@given(rows=st.integers(1, 4), cols=st.integers(1, 5), dim=st.sampled_from([None, 0, 1]))
def test_masked_mean_of_empty_mask_is_zero(rows, cols, dim):
    values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * 10 + cols))
    out = masked_mean(values, torch.zeros(rows, cols), dim=dim)
    assert torch.equal(out, torch.zeros_like(out))


# --------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    # token 0: pi = 0.5, ref = 0.25; token 1: pi = 0.25, ref = 0.5; ln 2 = 0.693147
    logprobs = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)]])
    # k1 = log pi - log ref = +ln 2, -ln 2 (k1 can be negative)
    close(kl_penalty(logprobs, ref, "k1"), [[0.6931, -0.6931]])
    # k2 = 0.5 * (ln 2)^2 = 0.5 * 0.480453 = 0.2402 for both
    close(kl_penalty(logprobs, ref, "k2"), [[0.2402, 0.2402]])
    # k3, log_ratio = log ref - log pi:
    #   token 0: log_ratio = -ln 2, e^-ln2 = 0.5 -> 0.5 + 0.6931 - 1 = 0.1931
    #   token 1: log_ratio = +ln 2, e^ln2 = 2   -> 2 - 0.6931 - 1   = 0.3069
    close(kl_penalty(logprobs, ref, "low_var_kl"), [[0.1931, 0.3069]])
    close(kl_penalty(logprobs, ref, "k3"), [[0.1931, 0.3069]])


def test_low_var_kl_clamps():
    # log_ratio = -30 -> clamped -20: e^-20 + 20 - 1 = 19.000000002 -> clamped to 10
    # log_ratio = +30 -> clamped +20: e^20 - 20 - 1 = 4.85e8       -> clamped to 10
    logprobs = torch.tensor([[0.0, -30.0]])
    ref = torch.tensor([[-30.0, 0.0]])
    close(kl_penalty(logprobs, ref, "low_var_kl"), [[10.0, 10.0]], atol=0)


def test_kl_unknown_kind_names_it():
    with pytest.raises(ValueError, match=r"'k4'.*k1, k2, k3, low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


@PROPERTY
@given(
    logprobs=st.floats(min_value=-10.0, max_value=0.0),
    delta=st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=5.0), st.floats(-5.0, -1e-3)),
)
def test_k3_is_nonnegative_and_zero_only_at_equality(logprobs, delta):
    # float64 so e^x - x - 1 ~ x^2 / 2 >= 5e-7 for |x| >= 1e-3 is not lost to cancellation
    lp = torch.tensor([[logprobs]], dtype=torch.float64)
    k3 = kl_penalty(lp, lp + delta, "low_var_kl")
    assert (k3 >= 0).all()
    assert bool((k3 == 0).all()) == (delta == 0.0)


def test_k1_mean_over_samples_estimates_true_kl():
    # pi = [0.5, 0.3, 0.2], ref = [0.2, 0.3, 0.5]:
    #   KL = 0.5 ln(2.5) + 0.3 ln(1) + 0.2 ln(0.4) = (0.5 - 0.2) * 0.916291 = 0.274887
    # k1 per sample takes +0.916291 (p 0.5), 0 (p 0.3), -0.916291 (p 0.2):
    #   E[k1^2] = 0.7 * 0.839589 = 0.587712, var = 0.587712 - 0.274887^2 = 0.512150, sd 0.7157
    #   with N = 100000 samples the standard error is 0.7157 / 316.2 = 0.00226;
    #   tolerance 0.01 is ~4.4 standard errors (and the seed makes it deterministic)
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    samples = torch.multinomial(pi, 100_000, replacement=True, generator=gen)
    k1 = kl_penalty(pi.log()[samples].view(1, -1), ref.log()[samples].view(1, -1), "k1")
    assert abs(k1.mean().item() - 0.274887) < 0.01


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 6))
def test_k1_mean_estimates_kl_for_random_categoricals(seed, vocab):
    gen = torch.Generator().manual_seed(seed)
    log_pi = torch.log_softmax(torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
    log_ref = torch.log_softmax(torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
    pi, n = log_pi.exp(), 20_000
    true_kl = (pi * (log_pi - log_ref)).sum()
    # tolerance: 5 exact standard errors of the mean of k1, plus float slack
    sd = torch.sqrt((pi * (log_pi - log_ref - true_kl) ** 2).sum())
    samples = torch.multinomial(pi, n, replacement=True, generator=gen)
    # mean over samples = sum over values of (count / n) * k1(value); same number, no [n] gather
    counts = torch.bincount(samples, minlength=vocab).to(torch.float64)  # [V]
    k1 = kl_penalty(log_pi.view(1, -1), log_ref.view(1, -1), "k1").view(-1)  # [V]
    assert abs((counts * k1).sum() / n - true_kl) <= 5 * sd / math.sqrt(n) + 1e-9


# --------------------------------------------------------------------------- entropy, logprobs


def test_entropy_by_hand():
    # uniform over 4: ln 4 = 1.3863
    # p = [0.5, 0.25, 0.25]: 0.5 ln 2 + 2 * 0.25 ln 4 = 0.3466 + 0.6931 = 1.0397
    # logits [1000, 1000]: shift-invariant, ln 2 = 0.6931 with no overflow
    # logits [0, -inf]: a one-hot distribution, entropy 0 (masked entry adds 0, not NaN)
    close(entropy_from_logits(torch.zeros(1, 1, 4)), [[1.3863]])
    close(entropy_from_logits(torch.tensor([0.5, 0.25, 0.25]).log().view(1, 1, 3)), [[1.0397]])
    close(entropy_from_logits(torch.full((1, 1, 2), 1000.0)), [[0.6931]])
    close(entropy_from_logits(torch.tensor([[[0.0, -math.inf]]])), [[0.0]])


def test_entropy_gradient_is_finite_with_masked_vocabulary():
    # the entropy bonus is differentiated; a -inf logit must not turn the gradient into NaN
    logits = torch.tensor([[[0.3, -1.2, -math.inf]]], requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 0, 2] == 0


@FEW
@given(vocab=st.integers(1, 64), level=st.floats(min_value=-100.0, max_value=100.0))
def test_entropy_of_uniform_is_log_vocab(vocab, level):
    logits = torch.full((2, 3, vocab), level, dtype=torch.float64)
    expected = torch.full((2, 3), math.log(vocab), dtype=torch.float64)
    close(entropy_from_logits(logits), expected, atol=1e-9)


def test_token_logprobs_by_hand():
    # logits [0, ln 3] -> softmax [1/4, 3/4]:
    #   token 1 -> ln 0.75 = -0.2877, token 0 -> ln 0.25 = -1.3863
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    close(token_logprobs(logits, torch.tensor([[1, 0]])), [[-0.2877, -1.3863]])
    # temperature 2: logits [0, ln sqrt 3] -> p1 = sqrt 3 / (1 + sqrt 3) = 1.7321 / 2.7321 = 0.6340,
    #   ln 0.6340 = -0.4557; p0 = 1 - 0.6340 = 0.3660, ln 0.3660 = -1.0051
    close(token_logprobs(logits, torch.tensor([[1, 0]]), temperature=2.0), [[-0.4557, -1.0051]])


def test_token_logprobs_upcasts_half_precision():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(1)).bfloat16()
    tokens = torch.tensor([[0, 6, 3], [2, 2, 5]])
    out = token_logprobs(logits, tokens)
    assert out.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    close(out, expected, atol=1e-5)


@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 50)),
    temperature=st.floats(min_value=0.1, max_value=3.0),
)
def test_token_logprobs_matches_log_softmax_gather(seed, shape, temperature):
    batch, length, vocab = shape
    gen = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(batch, length, vocab, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (batch, length), generator=gen)
    full = torch.log_softmax(logits / temperature, -1)  # [B, T, V]
    expected = full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, T]
    close(token_logprobs(logits, tokens, temperature), expected, atol=1e-6)


def test_token_logprobs_rejects_nonpositive_temperature():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), temperature=0.0)


# --------------------------------------------------------------------------- numerics: clamp, holes, groups of one


def _extreme_log_ratios():
    """logprobs (a leaf with grad) and old log-probs 100 apart both ways, and one equal: log-ratios [[100, -100, 0]]."""
    logprobs = torch.tensor([[-0.5, -120.0, -2.0]], requires_grad=True)
    return logprobs, logprobs.detach() - torch.tensor([[100.0, -100.0, 0.0]])


@pytest.mark.parametrize("loss_name, dual_clip", [("ppo", 0.0), ("ppo", 3.0), ("gspo", 0.0), ("cispo", 0.0)])
@pytest.mark.parametrize("sign", [1.0, -1.0, 0.0])
@pytest.mark.parametrize("kl_type", ["k1", "k2", "low_var_kl"])
def test_every_ratio_loss_is_finite_at_log_ratios_of_100(loss_name, dual_clip, sign, kl_type):
    # unclamped, exp(100) is inf in float32: -A * inf is +-inf, 0 * inf is NaN, and so are the gradients
    logprobs, old = _extreme_log_ratios()
    algo = AlgoConfig(policy_loss=loss_name, dual_clip=dual_clip, kl_coef=0.1, kl_type=kl_type, kl_unbiased=True, is_correction="tis")
    weights, metrics = is_weights(algo, logprobs.detach(), old, torch.ones(1, 3))
    extras = {"old_logprobs": old, "advantages": torch.full((1, 3), sign), "ref_logprobs": old + 50.0, "is_weights": weights}
    loss, terms = policy_loss(algo, logprobs, torch.zeros(1, 3), torch.ones(1, 3), extras)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logprobs.grad).all()
    assert all(torch.isfinite(v).all() for v in terms.values()) and all(math.isfinite(v) for v in metrics.values())


def test_log_ratio_clamp_values_by_hand():
    # clamp 5 (algo.log_ratio_clamp): a log-ratio of 100 gives ratio e^5 = 148.41, of -100 gives e^-5 = 0.0067379
    logprobs, old = _extreme_log_ratios()
    # PPO, A = -1, eps 0.2 / 0.28: r = 148.41: max(148.41, 1.28) = 148.41; r = e^-5: max(0.0067, 0.8) = 0.8; r = 1: 1
    loss, _ = ppo_clip_loss(logprobs, old, -torch.ones(1, 3), 0.2, 0.28, log_ratio_clamp=5.0)
    close(loss, [[148.4132, 0.8, 1.0]])
    loss.sum().backward()  # the clamp bites at +-100: no gradient through those ratios; r = 1 (unclipped) gives -A r = 1
    close(logprobs.grad, [[0.0, 0.0, 1.0]], atol=0)
    # unbiased k1 at the clamp: k1 = logp - ref = 1 on each token, times the clamped ratio e^5, e^-5, 1
    close(kl_penalty(logprobs.detach(), logprobs.detach() - 1.0, "k1", old, log_ratio_clamp=5.0), [[148.4132, 0.0067, 1.0]])
    # token IS weights, log w = +-100 clamped to +-5: tis truncates e^5 to is_upper 2, keeps e^-5; mis zeroes both
    tis, _ = importance_weights(logprobs.detach(), old, torch.ones(1, 3), "tis", "token", 0.5, 2.0, log_ratio_clamp=5.0)
    close(tis, [[2.0, 0.0067, 1.0]])
    mis, _ = importance_weights(logprobs.detach(), old, torch.ones(1, 3), "mis", "token", 0.5, 2.0, log_ratio_clamp=5.0)
    close(mis, [[0.0, 0.0, 1.0]], atol=0)


def test_gae_skips_a_hole_in_the_response_by_hand():
    # mask [1, 0, 1] (position 1: a tool's output), gamma 0.5, lam 0.5; the hole's reward 5 and value 9 are ignored:
    #   t=2: delta = 1 + 0.5 * 0 - 0.25 = 0.75,                 A_2 = 0.75
    #   t=1: skipped, the recursion passes through:             A_1 = 0
    #   t=0: delta = 0 + 0.5 * V_2 - 0.5 = 0.125 - 0.5 = -0.375, A_0 = -0.375 + 0.25 * 0.75 = -0.1875
    #   returns A + V = [0.3125, 0, 1.0]  (a reset at the hole would give A_0 = 0 + 0.5 * 9 * 0 - 0.5 = -0.5)
    adv, ret = gae(torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.25]]), torch.tensor([[1, 0, 1]]), 0.5, 0.5)
    close(adv, [[-0.1875, 0.0, 0.75]])
    close(ret, [[0.3125, 0.0, 1.0]])
    # the same as GAE on the row with the hole removed
    compact, _ = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.25]]), torch.ones(1, 2), 0.5, 0.5)
    close(adv[:, [0, 2]], compact, atol=1e-7)


def test_discounted_returns_skip_a_hole_by_hand():
    # mask [1, 0, 1, 0], gamma 0.5: G_2 = 2, G_1 = 0 (hole; its reward 7 ignored), G_0 = 1 + 0.5 * G_2 = 2 (a reset would give 1)
    returns = discounted_returns(torch.tensor([[1.0, 7.0, 2.0, 3.0]]), torch.tensor([[1, 0, 1, 0]]), 0.5)
    close(returns, [[2.0, 0.0, 2.0, 0.0]])


def test_group_of_one_in_every_estimator():
    rewards, mask = torch.tensor([5.0, -3.0]), torch.ones(2, 1)
    # grpo (both variants) and reinforce_plus_plus_baseline: reward minus its own group mean = 0
    for algo in (AlgoConfig(), AlgoConfig(normalize_std=False), AlgoConfig(advantage="reinforce_plus_plus_baseline")):
        advantages, _ = compute_advantages(algo, rewards, mask, 1, None, None)
        close(advantages, [[0.0], [0.0]], atol=0)
    # reinforce_plus_plus_baseline keeps the KL shaping: token rewards -1 * [0.2, 0.4]; whitened: mean -0.3,
    #   deviations +-0.1, var 0.02 / 1, std 0.14142 -> +-0.7071
    shaped = AlgoConfig(advantage="reinforce_plus_plus_baseline", kl_coef=1.0, kl_in_reward=True)
    close(compute_advantages(shaped, rewards, mask, 1, torch.tensor([[0.2], [0.4]]), None)[0], [[0.7071], [-0.7071]])
    # reinforce_plus_plus reads no groups: returns [5, -3], mean 1, deviations +-4, var 32, std 5.657 -> +-0.7071
    close(compute_advantages(AlgoConfig(advantage="reinforce_plus_plus"), rewards, mask, 1, None, None)[0], [[0.7071], [-0.7071]])
    # rloo: no other sample to average
    with pytest.raises(ValueError, match="rloo needs group_size >= 2.*got 1"):
        compute_advantages(AlgoConfig(advantage="rloo"), rewards, mask, 1, None, None)
