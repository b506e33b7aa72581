"""On-policy distillation's advantages (miles_core/algos/distill.py): hand-derived numbers, and the sign checked where
it matters, by enumerating every sample of a tiny student: the policy loss on those advantages descends the reverse KL."""

from __future__ import annotations

import pytest
import torch

from miles_core.algos.distill import distill_advantages, reverse_kl, with_teacher
from miles_core.algos.losses import ppo_clip_loss
from miles_core.config import ConfigError, DistillConfig

STUDENT = torch.tensor([[-0.5, -1.0, -2.0, 0.0]])  # log pi_s of the sampled tokens; the last position is padding
TEACHER = torch.tensor([[-1.0, -0.25, -2.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
ON = DistillConfig(teacher="s3://models/teacher", coef=2.0)


def test_the_reverse_kl_estimate_is_the_students_log_prob_minus_the_teachers():
    # k = log pi_s - log pi_t = [-0.5 + 1, -1 + 0.25, -2 + 2, padding]
    assert reverse_kl(STUDENT, TEACHER, MASK).tolist() == [[0.5, -0.75, 0.0, 0.0]]


def test_kl_mode_gives_each_token_minus_coef_times_its_own_reverse_kl():
    # A_t = -2 * k_t: the token the student over-weights is pushed down, the one it under-weights pulled up
    assert distill_advantages(STUDENT, TEACHER, MASK, "kl", coef=2.0).tolist() == [[-1.0, 1.5, 0.0, 0.0]]


def test_reward_mode_gives_each_token_the_return_of_the_dense_reward():
    # r = -2 * k = [-1, 1.5, 0]; gamma 1: G = [-1 + 1.5 + 0, 1.5 + 0, 0]; gamma 0.5: G_1 = 1.5, G_0 = -1 + 0.5 * 1.5
    assert distill_advantages(STUDENT, TEACHER, MASK, "reward", coef=2.0).tolist() == [[0.5, 1.5, 0.0, 0.0]]
    assert distill_advantages(STUDENT, TEACHER, MASK, "reward", coef=2.0, gamma=0.5).tolist() == [[-0.25, 1.5, 0.0, 0.0]]


def test_a_hole_in_the_loss_mask_is_no_step_of_the_returns():
    # the middle token is a tool's output: k = [0.5, -, -1], r = [-1, -, 2], G = [-1 + 2, 0, 2]
    student, teacher, mask = torch.tensor([[-0.5, -1.0, -2.0]]), torch.tensor([[-1.0, -0.25, -1.0]]), torch.tensor([[1.0, 0.0, 1.0]])
    assert distill_advantages(student, teacher, mask, "reward", coef=2.0).tolist() == [[1.0, 0.0, 2.0]]
    assert distill_advantages(student, teacher, mask, "kl", coef=2.0).tolist() == [[-1.0, 0.0, 2.0]]


def test_the_task_rewards_advantage_is_added_or_left_out():
    task = torch.tensor([[0.3, 0.3, 0.3, 0.0]])
    combined, metrics = with_teacher(ON, task, STUDENT, TEACHER, MASK)
    torch.testing.assert_close(combined, torch.tensor([[-0.7, 1.8, 0.3, 0.0]]))
    alone, _ = with_teacher(DistillConfig(teacher="s3://models/teacher", coef=2.0, with_reward=False), task, STUDENT, TEACHER, MASK)
    assert alone.tolist() == [[-1.0, 1.5, 0.0, 0.0]]
    # per-token means over the three response tokens: k (0.5 - 0.75 + 0) / 3, log pi_t (-1 - 0.25 - 2) / 3, A (-1 + 1.5) / 3
    assert metrics == pytest.approx({"distill/reverse_kl": -0.25 / 3, "distill/teacher_logprob": -3.25 / 3, "distill/advantage": 0.5 / 3})


def test_a_batch_the_teacher_did_not_score_is_refused():
    with pytest.raises(ValueError, match="carries no teacher log-probs"):
        with_teacher(ON, torch.zeros(1, 4), STUDENT, None, MASK)


def two_token_student(mode: str):
    """Every 2-token response of a student over 3 tokens (y1 ~ softmax(z1), y2 ~ softmax(z2[y1])) against a fixed teacher:
    the student's parameters, the expected policy loss on the distillation advantages, and the exact reverse KLs."""
    gen = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(3, generator=gen, requires_grad=True), torch.randn(3, 3, generator=gen, requires_grad=True)
    q1, q2 = torch.log_softmax(torch.randn(3, generator=gen), -1), torch.log_softmax(torch.randn(3, 3, generator=gen), -1)
    p1, p2 = torch.log_softmax(z1, -1), torch.log_softmax(z2, -1)
    responses = [(a, b) for a in range(3) for b in range(3)]
    student = torch.stack([torch.stack([p1[a], p2[a, b]]) for a, b in responses])  # [9, 2] with gradient
    teacher = torch.stack([torch.stack([q1[a], q2[a, b]]) for a, b in responses])  # [9, 2]
    mask = torch.ones(9, 2)
    advantages = distill_advantages(student.detach(), teacher, mask, mode, coef=1.0)
    loss, _ = ppo_clip_loss(student, student.detach(), advantages, 0.2, 0.28)  # ratio 1: the policy gradient
    probability = student.detach().sum(dim=1).exp()  # [9] each response's probability: the expectation is a weighted sum
    expected_loss = (probability.unsqueeze(1) * loss).sum()
    sequence_kl = (student.sum(dim=1).exp() * (student - teacher).sum(dim=1)).sum()  # KL(pi_s || pi_t) of whole responses
    first_kl = (p1.exp() * (p1 - q1)).sum()  # each position's KL, at the prefixes the student samples (no gradient through them)
    per_token_kl = first_kl + (p1.exp().detach() * (p2.exp() * (p2 - q2)).sum(dim=1)).sum()
    return (z1, z2), expected_loss, sequence_kl, per_token_kl


def gradients(value, params):
    return torch.cat([g.flatten() for g in torch.autograd.grad(value, params, retain_graph=True)])


def test_kl_mode_descends_each_positions_reverse_kl():
    params, expected_loss, sequence_kl, per_token_kl = two_token_student("kl")
    torch.testing.assert_close(gradients(expected_loss, params), gradients(per_token_kl, params))
    assert not torch.allclose(gradients(expected_loss, params), gradients(sequence_kl, params))  # no credit to earlier tokens


def test_reward_mode_descends_the_whole_responses_reverse_kl():
    params, expected_loss, sequence_kl, _ = two_token_student("reward")
    torch.testing.assert_close(gradients(expected_loss, params), gradients(sequence_kl, params))


@pytest.mark.parametrize(
    "values, message",
    [
        ({"teacher": "s3://t", "mode": "forward"}, "distill.mode: unknown mode 'forward' (available: kl, reward)"),
        ({"teacher": "s3://t", "coef": 0.0}, "distill.coef: must be > 0, got 0.0"),
        ({"teacher": "s3://t", "dtype": "float16"}, "distill.dtype: must be one of float32, bfloat16, got 'float16'"),
        ({"teacher": "hf://org/model"}, "distill.teacher: unknown scheme in 'hf://org/model'"),
        ({"with_reward": False}, "distill.with_reward: false leaves nothing to train on without a teacher"),
    ],
)
def test_a_bad_distill_section_is_refused_by_key_path(values, message):
    with pytest.raises(ConfigError) as err:
        DistillConfig(**values)
    assert str(err.value).startswith(message)
