"""One synchronous RL step, stage by stage: rollout -> score -> train (publishing is in weights/).

Each function is what one Flyte task runs; they only meet through samples, so the same stages
serve the looped DAG, the evaluation task and benchmarks.
"""

from __future__ import annotations

import functools
import math
import time

import torch

from miles_core.algos.advantages import broadcast_to_tokens, grpo_advantages
from miles_core.algos.losses import masked_mean
from miles_core.algos.objective import policy_loss
from miles_core.config import AlgoConfig, EvalConfig, RewardConfig, RolloutConfig
from miles_core.data.source import Prompt
from miles_core.models.tiny import encode_prompt
from miles_core.plugins import load_function
from miles_core.rollout.base import RolloutEngine, SamplingParams
from miles_core.samples import Sample
from miles_core.train.base import Trainer, pack


def rollout(engine: RolloutEngine, prompts: list[Prompt], tokenizer, cfg: RolloutConfig, seed: int) -> tuple[list[Sample], dict]:
    """Generate cfg.n_samples responses per prompt with the engine's current weights."""
    params = SamplingParams(
        n=cfg.n_samples, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        max_new_tokens=cfg.max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,), seed=seed,
    )
    generate_fn = load_function(cfg.generate_fn, "rollout.generate_fn", GENERATE_PARAMS)
    return generate_fn(engine, prompts, tokenizer, params)


GENERATE_PARAMS = ("engine", "prompts", "tokenizer", "params")


def generate(engine: RolloutEngine, prompts: list[Prompt], tokenizer, params: SamplingParams) -> tuple[list[Sample], dict]:
    """Single-turn generation, the default of the `rollout.generate_fn` plug-point.

    Returns params.n samples per prompt, grouped by prompt (prompt-major, sample index minor),
    each with prompt/response token ids as generated, rollout log-probs and loss mask, plus
    rollout metrics {name: float}.
    """
    started = time.perf_counter()
    prompt_tokens = [encode_prompt(tokenizer, p.text) for p in prompts]
    groups = engine.generate(prompt_tokens, params)
    samples = [
        Sample(
            prompt_id=p.id, index=i, prompt_tokens=tokens, response_tokens=g.tokens, rollout_logprobs=g.logprobs,
            loss_mask=[1] * len(g.tokens), finish_reason=g.finish_reason, weight_version=g.weight_version,
            label=p.label, metadata=p.metadata,
        )
        for p, tokens, group in zip(prompts, prompt_tokens, groups)
        for i, g in enumerate(group)
    ]
    seconds = time.perf_counter() - started
    lengths = [len(s.response_tokens) for s in samples]
    return samples, {
        "rollout/response_length": sum(lengths) / len(lengths),
        "rollout/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "rollout/tokens_per_s": sum(lengths) / seconds,
        "time/rollout_s": seconds,
    }


def score(samples: list[Sample], reward_fn, tokenizer, cfg: RewardConfig, group_size: int) -> dict:
    """Fill each sample's reward; a reward function that fails scores the sample cfg.min."""
    started = time.perf_counter()
    failures = 0
    for s in samples:
        text = tokenizer.decode(s.response_tokens, skip_special_tokens=True)
        try:
            s.reward = float(reward_fn(text, s.label, s.metadata))
            if math.isnan(s.reward):
                raise ValueError("reward is NaN")
            s.reward = min(max(s.reward, cfg.min), cfg.max)
        except Exception as err:  # a reward bug must not lose the rollout: recorded and counted instead
            s.reward, failures = cfg.min, failures + 1
            s.metadata = {**s.metadata, "reward_error": f"{type(err).__name__}: {err}"[:300]}
    rewards = torch.tensor([s.reward for s in samples]).view(-1, group_size)  # [G, n]
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/accuracy": float((rewards >= cfg.max).float().mean()),
        "reward/zero_std_group_fraction": float((rewards.std(dim=1) == 0).float().mean()) if group_size > 1 else 1.0,
        "reward/failures": float(failures),
        "time/score_s": time.perf_counter() - started,
    }


def train(trainer: Trainer, samples: list[Sample], algo: AlgoConfig, group_size: int, temperature: float, pad_id: int, reference: Trainer | None = None) -> dict:
    """GRPO: group-relative advantages, then PPO-clip steps on the batch."""
    started = time.perf_counter()
    batch = pack(samples, pad_id)
    current = trainer.logprobs(batch, temperature)  # [B, T] policy before this step's updates
    old_logprobs = batch.rollout_logprobs if algo.use_rollout_logprobs else current
    rewards = torch.tensor([s.reward for s in samples])  # [B]
    advantages = broadcast_to_tokens(grpo_advantages(rewards, group_size, algo.normalize_std), batch.response_mask)  # [B, T]
    extras = {"old_logprobs": old_logprobs, "advantages": advantages}
    if algo.kl_coef > 0:
        extras["ref_logprobs"] = reference.logprobs(batch, temperature)
    metrics = trainer.train_on(batch, extras, functools.partial(policy_loss, algo), temperature)
    delta = (current - batch.rollout_logprobs).abs()
    metrics["train/logprob_mismatch"] = float(masked_mean(delta, batch.response_mask))
    metrics["time/train_s"] = time.perf_counter() - started
    return metrics


def evaluate(engine: RolloutEngine, prompts: list[Prompt], tokenizer, reward_fn, reward: RewardConfig, cfg: EvalConfig) -> dict:
    """Greedy accuracy on held-out prompts."""
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    samples, _ = generate(engine, prompts, tokenizer, params)
    scored = score(samples, reward_fn, tokenizer, reward, group_size=1)
    return {"eval/accuracy": scored["reward/accuracy"], "eval/reward": scored["reward/mean"], "eval/prompts": float(len(prompts))}
