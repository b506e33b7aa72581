"""The algorithm library's pure functions: estimators, losses, IS weights, filters, dispatch.

Hand-derived numbers in the comments, properties with hypothesis, and the equivalences the
docstrings claim (Dr.GRPO, GSPO vs PPO and the GSPO paper's gradient, CISPO's gradient, GAE
with lam = gamma = 1, RLOO as rescaled GRPO centering).
"""

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
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
    token_rewards,
    whiten,
)
from miles_core.algos.losses import cispo_loss, gspo_loss, loss_weights, ppo_clip_loss, value_loss
from miles_core.algos.objective import compute_advantages
from miles_core.config import AlgoConfig

# Behaviour only: no per-example deadline, few examples so the file stays fast.
PROPERTY = settings(max_examples=30, deadline=None, derandomize=True, database=None)

finite = st.floats(min_value=-5.0, max_value=5.0, allow_nan=False, allow_infinity=False)
LN2 = math.log(2.0)


def close(actual: torch.Tensor, expected, atol: float = 1e-4) -> None:
    # plain allclose: torch.testing pulls in half a second of imports
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.allclose(actual, expected, rtol=0, atol=atol), f"{actual} vs {expected}"


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@st.composite
def batches(draw, max_rows: int = 4, max_len: int = 5, min_len: int = 1):
    """(mask [B, T] right-padded with every row non-empty, seed) for random float64 tensors."""
    rows = draw(st.integers(1, max_rows))
    length = draw(st.integers(min_len, max_len))
    lengths = draw(st.lists(st.integers(1, length), min_size=rows, max_size=rows))
    mask = (torch.arange(length).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).double()
    return mask, draw(st.integers(0, 2**31 - 1))


def randn(shape, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=gen, dtype=torch.float64)


# --------------------------------------------------------------------------- RLOO


def test_rloo_by_hand():
    # group [1, 0, 0, 1], sum 2, leave-one-out means (2 - r_i) / 3:
    #   r = 1: others' mean 1/3 -> 1 - 1/3 = +0.6667;  r = 0: others' mean 2/3 -> 0 - 2/3 = -0.6667
    #   (= G / (G - 1) * (r - mean) = 4/3 * ±0.5 = ±0.6667)
    # group [3, 1]: the other sample is the baseline -> 3 - 1 = 2, 1 - 3 = -2
    close(rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4), [0.6667, -0.6667, -0.6667, 0.6667])
    close(rloo_advantages(torch.tensor([3, 1]), 2), [2.0, -2.0])  # int rewards promoted to float


def test_rloo_rejects_group_of_one():
    with pytest.raises(ValueError, match="group_size >= 2.*got 1"):
        rloo_advantages(torch.tensor([1.0, 0.0]), 1)
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_advantages(AlgoConfig(advantage="rloo"), torch.tensor([1.0]), torch.ones(1, 1), 1, None, None)


@PROPERTY
@given(group_size=st.integers(2, 6), groups=st.integers(1, 4), data=st.data())
def test_grpo_and_rloo_sum_to_zero_per_group_and_rloo_is_rescaled_centering(group_size, groups, data):
    rewards = t64(data.draw(st.lists(finite, min_size=groups * group_size, max_size=groups * group_size)))
    rloo = rloo_advantages(rewards.float(), group_size).double()
    zeros = torch.zeros(groups, dtype=torch.float64)
    for normalize_std in (True, False):
        grpo = grpo_advantages(rewards, group_size, normalize_std=normalize_std)
        close(grpo.view(groups, group_size).sum(dim=1), zeros, atol=1e-6)
    # rloo runs in float32: |r| <= 5, so sums of 6 are exact to ~1e-5
    close(rloo.view(groups, group_size).sum(dim=1), zeros, atol=1e-4)
    # r_i - (S - r_i) / (G - 1) = (G r_i - S) / (G - 1) = G / (G - 1) * (r_i - S / G)
    centered = grpo_advantages(rewards, group_size, normalize_std=False)
    close(rloo, group_size / (group_size - 1) * centered, atol=1e-4)


# --------------------------------------------------------------------------- token rewards, returns, whiten


def test_token_rewards_by_hand():
    # last response token of each row: row 0 -> index 2, row 1 -> index 0, row 2 is empty (no token)
    rewards = torch.tensor([2.0, -1.0, 5.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    close(token_rewards(rewards, mask), [[0, 0, 2, 0], [-1, 0, 0, 0], [0, 0, 0, 0]])
    # kl_coef 0.5: minus 0.5 * kl on every response token (kl on padding is ignored):
    #   row 0: [-0.05, -0.10, 2 - 0.15 = 1.85, 0];  row 1: [-1 - 0.2 = -1.2, 0, 0, 0];  row 2: zeros
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.4, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    close(token_rewards(rewards, mask, kl, 0.5), [[-0.05, -0.1, 1.85, 0], [-1.2, 0, 0, 0], [0, 0, 0, 0]])
    # kl_coef 0 ignores kl
    close(token_rewards(rewards, mask, kl, 0.0), [[0, 0, 2, 0], [-1, 0, 0, 0], [0, 0, 0, 0]])


def test_discounted_returns_by_hand():
    # row 0, gamma 0.5: G_2 = 2, G_1 = 0 + 0.5 * 2 = 1, G_0 = 1 + 0.5 * 1 = 1.5; padding 0
    # row 1: the reward 4 sits on padding and is ignored: G_1 = 1, G_0 = 0 + 0.5 * 1 = 0.5
    rewards = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 1.0, 4.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    close(discounted_returns(rewards, mask, 0.5), [[1.5, 1.0, 2.0, 0.0], [0.5, 1.0, 0.0, 0.0]])
    # gamma 1: suffix sums, row 0 [1 + 0 + 2, 0 + 2, 2, 0] = [3, 2, 2, 0]; row 1 [1, 1, 0, 0]
    close(discounted_returns(rewards, mask, 1.0), [[3.0, 2.0, 2.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_whiten_by_hand():
    # masked entries 1, 2, 3 (100 is padding): mean 2, deviations -1, 0, 1, sum of squares 2,
    #   unbiased var 2 / (3 - 1) = 1 -> [-1, 0, 1, 0]
    close(whiten(torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1, 1, 1, 0]])), [[-1.0, 0.0, 1.0, 0.0]])
    # [1, 3, 5, 7] over two rows: mean 4, deviations -3, -1, 1, 3, sum of squares 20,
    #   var 20 / 3 = 6.6667, std 2.5820 -> -3 / 2.582 = -1.1619, -1 / 2.582 = -0.3873, ...
    close(whiten(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.ones(2, 2)), [[-1.1619, -0.3873], [0.3873, 1.1619]])
    # one masked entry: var 0 -> (v - v) * rsqrt(eps) = 0;  empty mask: zeros, not NaN
    close(whiten(torch.tensor([[4.0, 9.0]]), torch.tensor([[1, 0]])), [[0.0, 0.0]])
    close(whiten(torch.tensor([[4.0, 9.0]]), torch.zeros(1, 2)), [[0.0, 0.0]])


@PROPERTY
@given(batch=batches(max_rows=4, max_len=6), scale=st.floats(0.1, 10.0), shift=finite)
def test_whiten_has_mean_zero_and_unit_std_over_the_mask(batch, scale, shift):
    mask, seed = batch
    values = shift + randn(mask.shape, torch.Generator().manual_seed(seed), scale)
    picked = values[mask.bool()]
    if picked.numel() < 2 or picked.std() < 1e-2:  # std 1 needs some spread (eps is 1e-8)
        return
    out = whiten(values, mask)
    assert (out[~mask.bool()] == 0).all()
    kept = out[mask.bool()]
    assert abs(kept.mean().item()) < 1e-6
    assert abs(kept.std(correction=1).item() - 1.0) < 1e-4


# --------------------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_by_hand():
    rewards, mask = torch.tensor([1.0, 0.0]), torch.tensor([[1, 1], [1, 0]])
    # gamma 1: token rewards [[0, 1], [0, 0]], returns [[1, 1], [0, 0]];
    #   masked 1, 1, 0: mean 2/3, deviations 1/3, 1/3, -2/3, sum of squares 6/9, var (6/9) / 2 = 1/3,
    #   std 0.57735 -> 0.3333 / 0.57735 = 0.57735, -0.6667 / 0.57735 = -1.1547
    close(reinforce_plus_plus_advantages(rewards, mask), [[0.5774, 0.5774], [-1.1547, 0.0]])
    # gamma 0.5: returns [[0.5, 1], [0, 0]]; masked 0.5, 1, 0: mean 0.5, deviations 0, 0.5, -0.5,
    #   var 0.5 / 2 = 0.25, std 0.5 -> [[0, 1], [-1, 0]]
    close(reinforce_plus_plus_advantages(rewards, mask, gamma=0.5), [[0.0, 1.0], [-1.0, 0.0]])
    # KL shaped, coef 0.5, kl [[0.2, 0.4], [1.0, -]]: token rewards [[-0.1, 1 - 0.2], [-0.5, 0]],
    #   returns [[0.7, 0.8], [-0.5, 0]]; mean (0.7 + 0.8 - 0.5) / 3 = 1/3, deviations 11/30, 14/30,
    #   -25/30, sum of squares (121 + 196 + 625) / 900 = 1.046667, var 0.523333, std 0.723418
    #   -> 0.366667 / 0.723418 = 0.50685, 0.466667 / 0.723418 = 0.64508, -0.833333 / 0.723418 = -1.15194
    kl = torch.tensor([[0.2, 0.4], [1.0, 7.0]])
    close(reinforce_plus_plus_advantages(rewards, mask, 1.0, kl, 0.5), [[0.50685, 0.64508], [-1.15194, 0.0]])


def test_reinforce_plus_plus_baseline_by_hand():
    # groups [1, 0] and [3, 3], one token each; group means 0.5 and 3 -> centered [0.5, -0.5, 0, 0];
    #   whitened: mean 0, sum of squares 0.5, var 0.5 / 3 = 0.16667, std 0.40825 -> ±1.2247, 0, 0
    rewards, mask = torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.ones(4, 1)
    close(reinforce_plus_plus_baseline_advantages(rewards, 2, mask), [[1.2247], [-1.2247], [0.0], [0.0]])
    # without the baseline the easy prompt's samples look good: mean 1.75, deviations -0.75, -1.75,
    #   1.25, 1.25, sum of squares 6.75, var 2.25, std 1.5 -> [-0.5, -1.1667, 0.8333, 0.8333]
    close(reinforce_plus_plus_advantages(rewards, mask), [[-0.5], [-1.1667], [0.8333], [0.8333]])


# --------------------------------------------------------------------------- GAE


def test_gae_by_hand():
    # gamma 1, lam 0.5, V = [0.5, 0.6, 0.8], reward 1 on the last token:
    #   t=2: delta = 1 + 0 - 0.8 = 0.2,        A_2 = 0.2
    #   t=1: delta = 0 + 0.8 - 0.6 = 0.2,      A_1 = 0.2 + 0.5 * 0.2 = 0.3
    #   t=0: delta = 0 + 0.6 - 0.5 = 0.1,      A_0 = 0.1 + 0.5 * 0.3 = 0.25
    #   returns A + V = [0.75, 0.9, 1.0]
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.8]]), torch.ones(1, 3), 1.0, 0.5)
    close(adv, [[0.25, 0.3, 0.2]])
    close(ret, [[0.75, 0.9, 1.0]])
    # gamma 0.9, lam 1, padding at t=2 (its value 9 is ignored, V after the last token is 0):
    #   t=1: delta = 1 + 0.9 * 0 - 0.4 = 0.6,        A_1 = 0.6
    #   t=0: delta = 0 + 0.9 * 0.4 - 0.2 = 0.16,     A_0 = 0.16 + 0.9 * 0.6 = 0.7
    #   returns [0.9, 1.0, 0] (= the discounted returns: 0.9 * 1, 1)
    adv, ret = gae(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.2, 0.4, 9.0]]), torch.tensor([[1, 1, 0]]), 0.9, 1.0)
    close(adv, [[0.7, 0.6, 0.0]])
    close(ret, [[0.9, 1.0, 0.0]])


@PROPERTY
@given(batch=batches(), gamma=st.sampled_from([1.0, 0.9, 0.5]))
def test_gae_with_lambda_one_is_returns_minus_values(batch, gamma):
    mask, seed = batch
    gen = torch.Generator().manual_seed(seed)
    rewards, values = randn(mask.shape, gen) * mask, randn(mask.shape, gen)
    adv, ret = gae(rewards, values, mask, gamma, 1.0)
    # lam = 1: the deltas telescope, A_t = sum_s gamma^(s-t) r_s - V_t (= returns - values at gamma 1)
    expected_returns = discounted_returns(rewards, mask, gamma)
    close(adv, (expected_returns - values) * mask, atol=1e-9)
    close(ret, expected_returns, atol=1e-9)


@PROPERTY
@given(batch=batches())
def test_gae_with_lambda_zero_is_one_step_td(batch):
    mask, seed = batch
    gen = torch.Generator().manual_seed(seed)
    rewards, values = randn(mask.shape, gen) * mask, randn(mask.shape, gen)
    adv, _ = gae(rewards, values, mask, 1.0, 0.0)
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros(mask.shape[0], 1, dtype=values.dtype)], dim=1)
    close(adv, (rewards + next_values - values) * mask, atol=1e-9)


# --------------------------------------------------------------------------- PPO dual clip


def test_ppo_dual_clip_by_hand():
    # eps 0.2 / 0.2 -> clip range [0.8, 1.2]; dual_clip c = 3 bounds a negative-advantage loss at -3 A
    #   A=-1, r=5:   unclipped 5, clipped 1.2, max 5 > bound 3     -> 3,    dual clip active -> 1
    #   A=-1, r=2:   unclipped 2, clipped 1.2, max 2 < bound 3     -> 2,    unclipped active -> 0
    #   A= 1, r=5:   unclipped -5, clipped -1.2 (dual only for A<0) -> -1.2, clipped active  -> 1
    #   A=-2, r=0.5: unclipped 1, clipped 1.6, max 1.6 < bound 6   -> 1.6,  clipped active   -> 1
    ratio = torch.tensor([[5.0, 2.0], [5.0, 0.5]])
    adv = torch.tensor([[-1.0, -1.0], [1.0, -2.0]])
    old = torch.full_like(ratio, -1.0)
    loss, clipped = ppo_clip_loss(old + ratio.log(), old, adv, 0.2, 0.2, dual_clip=3.0)
    close(loss, [[3.0, 2.0], [-1.2, 1.6]])
    close(clipped, [[1.0, 0.0], [1.0, 1.0]], atol=0)
    # off (0, and anything <= 1): A=-1, r=5 keeps its loss 5
    for off in (0.0, 1.0):
        close(ppo_clip_loss(old + ratio.log(), old, adv, 0.2, 0.2, dual_clip=off)[0], [[5.0, 2.0], [-1.2, 1.6]])


token_rows = st.lists(st.tuples(finite, finite, finite), min_size=1, max_size=8)
eps_range = st.floats(min_value=0.0, max_value=0.5)


def _columns(rows):
    return (t64(list(column)).view(1, -1) for column in zip(*rows))


@PROPERTY
@given(rows=token_rows, eps_low=eps_range, eps_high=eps_range, dual=st.floats(1.01, 10.0))
def test_clipped_objective_never_exceeds_unclipped_and_dual_clip_never_increases_loss(rows, eps_low, eps_high, dual):
    logprobs, old, adv = _columns(rows)
    ratio = torch.exp(logprobs - old)
    plain, _ = ppo_clip_loss(logprobs, old, adv, eps_low, eps_high)
    # pessimistic bound: the objective -loss = min(A r, A clip(r)) <= A r (the loss >= -A r)
    assert (-plain <= adv * ratio + 1e-9).all()
    dual_loss, dual_clipped = ppo_clip_loss(logprobs, old, adv, eps_low, eps_high, dual_clip=dual)
    assert (dual_loss <= plain).all()
    # it only ever lowers negative-advantage tokens, and only down to -c A
    assert torch.equal(dual_loss[adv >= 0], plain[adv >= 0])
    close(dual_loss, torch.minimum(plain, torch.where(adv < 0, -dual * adv, plain)), atol=0)
    assert (dual_clipped[dual_loss < plain] == 1).all()


# --------------------------------------------------------------------------- GSPO


def test_gspo_by_hand():
    # eps 0.2 / 0.2 -> [0.8, 1.2]
    # row 0: log ratios [ln 2, 0], mean ln 2 / 2 -> s = sqrt 2 = 1.4142, A = 1:
    #   unclipped -1.4142, clipped -1.2, max -1.2 on both tokens, both clipped; no gradient (clamped)
    # row 1: mask [1, 0], log ratio ln 0.9 (the padded 5.0 is ignored) -> s = 0.9, A = -1:
    #   inside the range, loss -(-1) * 0.9 = 0.9; gradient -A * s = 0.9; padding 0
    old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    logprobs = (old + torch.tensor([[LN2, 0.0], [math.log(0.9), 5.0]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, clipped = gspo_loss(logprobs, old, adv, mask, 0.2, 0.2)
    close(loss.detach(), [[-1.2, -1.2], [0.9, 0.0]])
    close(clipped, [[1.0, 1.0], [0.0, 0.0]], atol=0)
    loss.sum().backward()
    close(logprobs.grad, [[0.0, 0.0], [0.9, 0.0]])


@PROPERTY
@given(rows=token_rows, eps_low=eps_range, eps_high=eps_range)
def test_gspo_with_one_token_responses_is_token_level_ppo(rows, eps_low, eps_high):
    logprobs, old, adv = (column.view(-1, 1) for column in _columns(rows))  # [B, 1]
    lp_gspo, lp_ppo = logprobs.clone().requires_grad_(), logprobs.clone().requires_grad_()
    gspo, gspo_clipped = gspo_loss(lp_gspo, old, adv, torch.ones_like(adv), eps_low, eps_high)
    ppo, ppo_clipped = ppo_clip_loss(lp_ppo, old, adv, eps_low, eps_high)
    close(gspo.detach(), ppo.detach(), atol=1e-9)
    assert torch.equal(gspo_clipped, ppo_clipped)
    gspo.sum().backward()
    ppo.sum().backward()
    close(lp_gspo.grad, lp_ppo.grad, atol=1e-9)


@PROPERTY
@given(batch=batches(max_len=6))
def test_gspo_gradient_with_seq_mean_token_mean_is_the_papers(batch):
    mask, seed = batch
    gen = torch.Generator().manual_seed(seed)
    old = randn(mask.shape, gen) - 1.0
    logprobs = (old + randn(mask.shape, gen, 0.3)).requires_grad_()
    adv = broadcast_to_tokens(randn(mask.shape[:1], gen), mask)
    # a clip range no ratio reaches: [0, 1e6]
    loss, clipped = gspo_loss(logprobs, old, adv, mask, 1.0, 1e6)
    assert clipped.sum() == 0
    (loss * loss_weights(mask, "seq-mean-token-mean").double()).sum().backward()  # float32 weights
    # the paper: grad J = (1/G) sum_i s_i A_i (1/|y_i|) sum_t grad logp_t, and the loss is -J
    lengths = mask.sum(dim=1, keepdim=True)
    s = torch.exp(((logprobs.detach() - old) * mask).sum(dim=1, keepdim=True) / lengths)  # [B, 1]
    expected = -(s * adv[:, :1] / lengths) * mask / mask.shape[0]
    close(logprobs.grad, expected, atol=1e-6)
    # and the same as differentiating J = (1/G) sum_i s_i(theta) A_i directly
    direct = logprobs.detach().clone().requires_grad_()
    s_theta = torch.exp(((direct - old) * mask).sum(dim=1) / lengths.squeeze(1))
    (-(s_theta * adv[:, 0]).mean()).backward()
    close(logprobs.grad, direct.grad, atol=1e-6)


# --------------------------------------------------------------------------- CISPO


def test_cispo_by_hand():
    # eps_low 0.2, eps_high 0.28 -> weights clipped to [0.8, 1.28]; loss = -w A logp
    #   logp ln 0.5 = -0.6931, old ln 0.25: r 2 -> w 1.28, A  1: -1.28 * 1 * -0.6931 = 0.8873, clipped
    #   logp ln 0.5, old ln 0.5:            r 1 -> w 1,    A -2: -1 * -2 * -0.6931  = -1.3863
    #   logp ln 0.25 = -1.3863, old ln 0.5: r 0.5 -> w 0.8, A -1: -0.8 * -1 * -1.3863 = -1.1090, clipped
    # gradient -w A: [-1.28, 2, 0.8] -- the clipped tokens still get one (PPO would give token 0 none)
    logprobs = torch.tensor([[math.log(0.5), math.log(0.5), math.log(0.25)]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.5), math.log(0.5)]])
    adv = torch.tensor([[1.0, -2.0, -1.0]])
    loss, clipped = cispo_loss(logprobs, old, adv, 0.2, 0.28)
    close(loss.detach(), [[0.8873, -1.3863, -1.1090]])
    close(clipped, [[1.0, 0.0, 1.0]], atol=0)
    loss.sum().backward()
    close(logprobs.grad, [[-1.28, 2.0, 0.8]])


@PROPERTY
@given(rows=token_rows, eps_low=eps_range, eps_high=eps_range)
def test_cispo_gradient_is_clipped_ratio_times_advantage(rows, eps_low, eps_high):
    logprobs, old, adv = _columns(rows)
    logprobs = logprobs.requires_grad_()
    loss, _ = cispo_loss(logprobs, old, adv, eps_low, eps_high)
    loss.sum().backward()
    ratio = torch.exp(logprobs.detach() - old)
    close(logprobs.grad, -torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv, atol=1e-9)


# --------------------------------------------------------------------------- value loss


def test_value_loss_by_hand():
    # clip 0.2 -> V is kept within V_old ± 0.2
    #   V 1, V_old 0.5, R 2:  clipped V 0.7; (1 - 2)^2 = 1 < (0.7 - 2)^2 = 1.69 -> 0.5 * 1.69 = 0.845, clipped
    #   V 1, V_old 0.9, R 2:  inside, clipped V = V; both 1                     -> 0.5
    #   V 0, V_old 0.5, R -1: clipped V 0.3; 1 < (0.3 + 1)^2 = 1.69             -> 0.845, clipped
    #   V 0, V_old 0.5, R 1:  clipped V 0.3; 1 > (0.3 - 1)^2 = 0.49             -> 0.5
    values = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    old = torch.tensor([[0.5, 0.9], [0.5, 0.5]])
    returns = torch.tensor([[2.0, 2.0], [-1.0, 1.0]])
    loss, clipped = value_loss(values, old, returns, 0.2)
    close(loss, [[0.845, 0.5], [0.845, 0.5]])
    close(clipped, [[1.0, 0.0], [1.0, 0.0]], atol=0)
