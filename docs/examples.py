"""One example implementation per plug-point; docs/plugins.md explains each.

Point a recipe at any of them, e.g. `reward: {post_fn: "docs.examples:length_penalty"}`
(paths resolve from the repository root, where `pyflyte run` starts).
"""

from __future__ import annotations

import dataclasses

import torch

from miles_core import step
from miles_core.algos.advantages import broadcast_to_tokens
from miles_core.data.source import PromptSource
from miles_core.rollout.base import SamplingParams


class ShortestFirst(PromptSource):
    """The first epoch in order of prompt length, later epochs shuffled as by default."""

    def _permutation(self, epoch: int) -> list[int]:
        if epoch:
            return super()._permutation(epoch)
        return sorted(range(len(self._prompts)), key=lambda i: len(self._prompts[i].text))


def shortest_first(prompts, seed, state):
    """data.source_fn: a curriculum, the shortest prompts first."""
    return ShortestFirst(prompts, seed, state)


def rollout_without_buffer(engine, source, tokenizer, fns, scorer, buffer, seed):
    """rollout.rollout_fn: the default rollout, but leftover groups are discarded."""
    samples, _, metrics = step.rollout(engine, source, tokenizer, fns, scorer, buffer, seed)
    return samples, [], metrics


def generate_short(engine, prompts, tokenizer, params: SamplingParams):
    """rollout.generate_fn: single-turn generation with at most 4 new tokens."""
    return step.generate(engine, prompts, tokenizer, dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, 4)))


def drop_truncated_groups(group):
    """rollout.dynamic_filter_fn: drop a group when every response hit the token budget."""
    return "all_truncated" if all(s.finish_reason == "length" for s in group) else None


def newest_first(buffer, n):
    """rollout.buffer_filter_fn: the freshest groups first (least off-policy)."""
    order = sorted(range(len(buffer)), key=lambda i: -buffer[i][0].weight_version)
    return [buffer[i] for i in order[:n]], [buffer[i] for i in order[n:]]


def exact_text(response, label, metadata):
    """reward.fn: 1 when the stripped response equals the label."""
    return float(response.strip() == label.strip())


def shortest_correct_bonus(reward_fn, responses):
    """reward.group_fn: each response's reward, plus 0.5 for the shortest correct one(s)."""
    rewards = [reward_fn(r.text, r.label, r.metadata) for r in responses]
    correct = [len(r.text) for r, x in zip(responses, rewards) if x > 0]
    return [x + 0.5 * (x > 0 and len(r.text) == min(correct)) for r, x in zip(responses, rewards)]


def length_penalty(samples, group_size):
    """reward.post_fn: 0.01 less reward per response token."""
    for s in samples:
        s.reward -= 0.01 * len(s.response_tokens)


def sign_advantages(algo, rewards, mask, group_size, kl, values):
    """algo.advantage_fn: +1 above the group mean, -1 below, 0 at it."""
    grouped = rewards.float().view(-1, group_size)
    signs = torch.sign(grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    return broadcast_to_tokens(signs, mask), None


def vanilla_pg_loss(algo, logprobs, entropy, mask, extras):
    """algo.loss_fn: plain policy gradient -A * log pi, no ratio, no clipping."""
    return -extras["advantages"] * logprobs, {}


def clamp_token_weights(algo, train_logprobs, rollout_logprobs, mask):
    """algo.is_correction_fn: token weights pi_train / pi_rollout clamped to [0.8, 1.25]."""
    weights = torch.exp(train_logprobs - rollout_logprobs).clamp(0.8, 1.25) * mask
    return weights, {"mismatch/is_weight_mean": float((weights * mask).sum() / mask.sum().clamp(min=1))}


def skip_truncated(sample):
    """algo.sample_filter_fn: do not train on responses cut off by the token budget."""
    return sample.finish_reason != "length"


def pass_at_4(engine, prompts, tokenizer, fns):
    """evaluation.fn: pass@4 with temperature-1 sampling, besides the greedy accuracy."""
    metrics = step.evaluate(engine, prompts, tokenizer, fns)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=fns.evaluation.max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,), seed=0)
    samples, _ = fns.generate_fn(engine, prompts, tokenizer, params)
    step.score(samples, fns, tokenizer, group_size=4)
    solved = torch.tensor([s.reward >= fns.reward.max for s in samples]).view(-1, 4).any(dim=1)
    return {**metrics, "eval/pass_at_4": float(solved.float().mean())}


def print_batch(trainer, samples, iteration):
    """hooks.before_train_step: one line about the batch about to be trained on."""
    print(f"iteration {iteration}: training on {len(samples)} samples at optimizer step {trainer.step}")


def stop_on_nan(trainer, metrics, iteration):
    """hooks.after_train_step: fail the step, before its checkpoint is written, if the loss is NaN."""
    if metrics.get("train/loss", 0.0) != metrics.get("train/loss", 0.0):
        raise FloatingPointError(f"iteration {iteration}: train/loss is NaN")


def print_checkpoint(ckpt_dir, iteration):
    """hooks.after_save: announce each complete checkpoint (e.g. to copy it elsewhere)."""
    print(f"iteration {iteration}: checkpoint complete at {ckpt_dir}")


def reward_by_length(samples, metrics, iteration):
    """hooks.rollout_log: mean reward of the shorter and the longer half of the responses."""
    ordered = sorted(samples, key=lambda s: len(s.response_tokens))
    half = len(ordered) // 2 or 1
    return {
        "rollout/reward_short_half": sum(s.reward for s in ordered[:half]) / half,
        "rollout/reward_long_half": sum(s.reward for s in ordered[half:]) / max(len(ordered) - half, 1),
    }
