"""The algorithm library, part three: filters, compute_advantages and policy_loss, the pieces the
step composes. Hand-derived numbers in the comments and properties with hypothesis, on the helpers
of test_algos_library.py."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from miles_core.algos.advantages import (
    broadcast_to_tokens,
)
from miles_core.algos.filters import keep_all, nonzero_reward_std, oldest_first
from miles_core.algos.losses import cispo_loss, gspo_loss, loss_weights, ppo_clip_loss
from miles_core.algos.objective import compute_advantages, policy_loss, sft_loss
from miles_core.config import AlgoConfig
from miles_core.samples import Sample
from tests.unit.test_algos_library import LN2, PROPERTY, close, finite, t64

# --------------------------------------------------------------------------- filters


def _sample(index: int, reward: float = 0.0, version: int = 0, prompt: str = "p") -> Sample:
    return Sample(prompt, index, [1], [2, 3], [-0.1, -0.2], [1, 1], "stop", version, "4", reward=reward)


def test_nonzero_reward_std():
    # all-equal rewards carry no signal (zero advantage): dropped, the reason names the reward
    assert nonzero_reward_std([_sample(0, 1.0), _sample(1, 1.0)]) == "zero_std_reward_1"
    assert nonzero_reward_std([_sample(0, 0.5), _sample(1, 0.5), _sample(2, 0.5)]) == "zero_std_reward_0.5"
    assert nonzero_reward_std([_sample(0, 0.0)]) == "zero_std_reward_0"
    assert nonzero_reward_std([_sample(0, 1.0), _sample(1, 0.0)]) is None


def names(groups: list[list[Sample]]) -> list[str]:
    return [group[0].prompt_id for group in groups]


def test_oldest_first():
    # weight versions a 3, b 1, c 2, d 1: the two oldest are b and d (version 1, arrival order)
    buffer = [[_sample(0, version=v, prompt=name)] for name, v in zip("abcd", [3, 1, 2, 1])]
    taken, rest = oldest_first(buffer, 2)
    assert names(taken) == ["b", "d"] and names(rest) == ["a", "c"]
    taken, rest = oldest_first(buffer, 0)
    assert taken == [] and names(rest) == ["a", "b", "c", "d"]
    taken, rest = oldest_first(buffer, 10)
    assert names(taken) == ["b", "d", "c", "a"] and rest == []
    assert oldest_first([], 3) == ([], [])


def test_keep_all():
    assert keep_all(_sample(0)) is True


# --------------------------------------------------------------------------- compute_advantages


GROUP_REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0])
GROUP_MASK = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]])


def test_compute_advantages_grpo_and_rloo():
    # grpo: ±0.8660 (see grpo by hand: ±0.5 / sqrt(1/3)) on each response token
    adv, returns = compute_advantages(AlgoConfig(), GROUP_REWARDS, GROUP_MASK, 4, None, None)
    close(adv, [[0.866, 0.866], [-0.866, 0.0], [-0.866, -0.866], [0.0, 0.0]])
    assert returns is None
    # Dr.GRPO (normalize_std False): centering only, ±0.5
    adv, _ = compute_advantages(AlgoConfig(normalize_std=False), GROUP_REWARDS, GROUP_MASK, 4, None, None)
    close(adv, [[0.5, 0.5], [-0.5, 0.0], [-0.5, -0.5], [0.0, 0.0]])
    # rloo: ±2/3
    adv, returns = compute_advantages(AlgoConfig(advantage="rloo"), GROUP_REWARDS, GROUP_MASK, 4, None, None)
    close(adv, [[0.6667, 0.6667], [-0.6667, 0.0], [-0.6667, -0.6667], [0.0, 0.0]])
    assert returns is None


def test_compute_advantages_kl_shaped_outcome_rewards():
    # kl_coef 0.5, per-token kl [[0.2, 0.4], [0.1, pad]]: the sequence's summed KL comes off its reward:
    #   1 - 0.5 * 0.6 = 0.7 and 0 - 0.5 * 0.1 = -0.05
    rewards, mask = torch.tensor([1.0, 0.0]), torch.tensor([[1, 1], [1, 0]])
    kl = torch.tensor([[0.2, 0.4], [0.1, 9.0]])
    shaped = AlgoConfig(normalize_std=False, kl_coef=0.5, kl_in_reward=True)
    # Dr.GRPO: mean 0.325 -> ±0.375
    close(compute_advantages(shaped, rewards, mask, 2, kl, None)[0], [[0.375, 0.375], [-0.375, 0.0]])
    # rloo: 0.7 - (-0.05) = 0.75 and -0.75
    rloo = AlgoConfig(advantage="rloo", kl_coef=0.5, kl_in_reward=True)
    close(compute_advantages(rloo, rewards, mask, 2, kl, None)[0], [[0.75, 0.75], [-0.75, 0.0]])
    # kl_in_reward False: the reward is untouched (the KL goes into the loss): ±0.5
    in_loss = AlgoConfig(normalize_std=False, kl_coef=0.5)
    close(compute_advantages(in_loss, rewards, mask, 2, kl, None)[0], [[0.5, 0.5], [-0.5, 0.0]])


def test_compute_advantages_reinforce_plus_plus_variants():
    # same numbers as test_reinforce_plus_plus_by_hand (KL shaped, coef 0.5, gamma 1)
    rewards, mask = torch.tensor([1.0, 0.0]), torch.tensor([[1, 1], [1, 0]])
    kl = torch.tensor([[0.2, 0.4], [1.0, 7.0]])
    algo = AlgoConfig(advantage="reinforce_plus_plus", kl_coef=0.5, kl_in_reward=True)
    adv, returns = compute_advantages(algo, rewards, mask, 2, kl, None)
    close(adv, [[0.50685, 0.64508], [-1.15194, 0.0]])
    assert returns is None
    # same numbers as test_reinforce_plus_plus_baseline_by_hand
    algo = AlgoConfig(advantage="reinforce_plus_plus_baseline")
    adv, _ = compute_advantages(algo, torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.ones(4, 1), 2, None, None)
    close(adv, [[1.2247], [-1.2247], [0.0], [0.0]])


def test_compute_advantages_ppo():
    # rewards [1] -> token rewards [0, 0, 1]; GAE as in test_gae_by_hand (gamma 1, lam 0.5):
    #   A = [0.25, 0.3, 0.2], returns [0.75, 0.9, 1.0]
    #   whitened A: mean 0.25, deviations 0, 0.05, -0.05, var 0.005 / 2 = 0.0025, std 0.05 -> [0, 1, -1]
    algo = AlgoConfig(advantage="ppo", lam=0.5)
    values = torch.tensor([[0.5, 0.6, 0.8]])
    adv, returns = compute_advantages(algo, torch.tensor([1.0]), torch.ones(1, 3), 1, None, values)
    close(adv, [[0.0, 1.0, -1.0]], atol=1e-3)
    close(returns, [[0.75, 0.9, 1.0]])
    # KL shaped, coef 0.5, kl 0.2 per token: token rewards [-0.1, -0.1, 0.9]
    #   t=2: delta 0.9 - 0.8 = 0.1, A 0.1;  t=1: delta -0.1 + 0.8 - 0.6 = 0.1, A 0.1 + 0.5 * 0.1 = 0.15
    #   t=0: delta -0.1 + 0.6 - 0.5 = 0, A 0 + 0.5 * 0.15 = 0.075 -> returns [0.575, 0.75, 0.9]
    shaped = AlgoConfig(advantage="ppo", lam=0.5, kl_coef=0.5, kl_in_reward=True)
    _, returns = compute_advantages(shaped, torch.tensor([1.0]), torch.ones(1, 3), 1, torch.full((1, 3), 0.2), values)
    close(returns, [[0.575, 0.75, 0.9]])


@PROPERTY
@given(group_size=st.integers(1, 5), groups=st.integers(1, 3), data=st.data())
def test_dr_grpo_is_grpo_without_the_std(group_size, groups, data):
    rewards = t64(data.draw(st.lists(finite, min_size=groups * group_size, max_size=groups * group_size)))
    mask = torch.ones(groups * group_size, 3, dtype=torch.float64)
    mask[::2, 2] = 0
    adv, _ = compute_advantages(AlgoConfig(normalize_std=False), rewards, mask, group_size, None, None)
    grouped = rewards.view(groups, group_size)
    centered = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    close(adv, centered.unsqueeze(1) * mask, atol=1e-9)


# --------------------------------------------------------------------------- policy_loss


def _extras(**more):
    # one token: logp = old = 0 (ratio 1), A = 2
    return {"old_logprobs": torch.zeros(1, 1), "advantages": torch.full((1, 1), 2.0), **more}


def test_policy_loss_terms_by_hand():
    logprobs, entropy, mask = torch.zeros(1, 1), torch.full((1, 1), 1.5), torch.ones(1, 1)
    # ratio 1: the PPO term is -A = -2
    loss, metrics = policy_loss(AlgoConfig(), logprobs, entropy, mask, _extras())
    close(loss, [[-2.0]])
    close(metrics["ratio"], [[1.0]])
    close(metrics["clip_fraction"], [[0.0]])
    assert "kl" not in metrics
    # + KL loss: k1 = 0 - (-0.5) = 0.5, coef 0.1 -> +0.05; - entropy bonus 0.01 * 1.5 = 0.015
    #   -2 + 0.05 - 0.015 = -1.965
    algo = AlgoConfig(kl_coef=0.1, kl_type="k1", entropy_coef=0.01)
    loss, metrics = policy_loss(algo, logprobs, entropy, mask, _extras(ref_logprobs=torch.full((1, 1), -0.5)))
    close(loss, [[-1.965]])
    close(metrics["kl"], [[0.5]])
    # IS weight 0.5 multiplies the policy-gradient term only: -2 * 0.5 + 0.05 - 0.015 = -0.965
    extras = _extras(ref_logprobs=torch.full((1, 1), -0.5), is_weights=torch.full((1, 1), 0.5))
    close(policy_loss(algo, logprobs, entropy, mask, extras)[0], [[-0.965]])
    # kl_in_reward: no KL term in the loss (and no reference log-probs needed): -2 - 0.015 = -2.015
    shaped = AlgoConfig(kl_coef=0.1, kl_in_reward=True, entropy_coef=0.01)
    loss, metrics = policy_loss(shaped, logprobs, entropy, mask, _extras())
    close(loss, [[-2.015]])
    assert "kl" not in metrics


def test_policy_loss_unbiased_kl_uses_the_old_policy():
    # logp ln 0.5, old ln 0.25 (ratio 2), ref ln 0.25: k1 = ln 2 = 0.6931, unbiased 2 * 0.6931 = 1.3863
    logprobs = torch.full((1, 1), math.log(0.5))
    extras = {
        "old_logprobs": torch.full((1, 1), math.log(0.25)),
        "advantages": torch.zeros(1, 1),
        "ref_logprobs": torch.full((1, 1), math.log(0.25)),
    }
    plain = AlgoConfig(kl_coef=1.0, kl_type="k1")
    close(policy_loss(plain, logprobs, torch.zeros(1, 1), torch.ones(1, 1), extras)[1]["kl"], [[0.6931]])
    unbiased = AlgoConfig(kl_coef=1.0, kl_type="k1", kl_unbiased=True)
    close(policy_loss(unbiased, logprobs, torch.zeros(1, 1), torch.ones(1, 1), extras)[1]["kl"], [[1.3863]])


def test_policy_loss_dispatches_to_each_loss():
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(3, 4, generator=gen) - 1.0
    logprobs = old + 0.5 * torch.randn(3, 4, generator=gen)
    adv = broadcast_to_tokens(torch.tensor([1.0, -1.0, 0.5]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]))
    mask = (adv != 0).float()
    extras = {"old_logprobs": old, "advantages": adv}
    entropy = torch.zeros(3, 4)
    cases = {
        AlgoConfig(dual_clip=3.0): ppo_clip_loss(logprobs, old, adv, 0.2, 0.28, 3.0),
        AlgoConfig(policy_loss="gspo", eps_clip_low=3e-4, eps_clip_high=4e-4): gspo_loss(logprobs, old, adv, mask, 3e-4, 4e-4),
        AlgoConfig(policy_loss="cispo", eps_clip_high=5.0): cispo_loss(logprobs, old, adv, 0.2, 5.0),
    }
    for algo, (expected_loss, expected_clipped) in cases.items():
        loss, metrics = policy_loss(algo, logprobs, entropy, mask, extras)
        close(loss, expected_loss, atol=0)
        close(metrics["clip_fraction"], expected_clipped, atol=0)
        weights = torch.rand(3, 4, generator=gen)
        close(policy_loss(algo, logprobs, entropy, mask, {**extras, "is_weights": weights})[0], expected_loss * weights, atol=1e-7)


def test_sft_loss_is_cross_entropy_on_the_loss_masked_tokens():
    # log-probs [[ln .5, ln .25], [ln 1, ln .1]], the last token masked (a tool's output, padding):
    #   per-token loss -log p = [[ln 2, 2 ln 2], [0, ln 10]]; token-mean weights 1/3 on the 3 kept
    #   tokens -> (ln 2 + 2 ln 2 + 0) / 3 = ln 2; the masked ln 10 contributes nothing
    logprobs = torch.tensor([[math.log(0.5), math.log(0.25)], [0.0, math.log(0.1)]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, metrics = sft_loss(logprobs, torch.zeros_like(logprobs), mask, {})
    close(loss, [[LN2, 2 * LN2], [0.0, math.log(10.0)]])
    assert metrics == {}
    close((loss * loss_weights(mask, "token-mean")).sum(), LN2)
