"""One synchronous RL step, stage by stage: rollout -> score -> train (publishing is in weights/).

Each function is what one Flyte task runs; they only meet through samples, so the same stages
serve the looped DAG, the asynchronous phase, the evaluation task and benchmarks. `rollout`,
`generate` and `evaluate` are also the defaults of their plug-points (signatures in their
docstrings and in `miles_core.plugins.PLUGPOINTS`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import time
from collections import Counter

import torch

from miles_core.algos.corrections import mismatch_metrics
from miles_core.algos.kl import kl_penalty
from miles_core.algos.losses import loss_weights
from miles_core.algos.objective import critic_loss
from miles_core.config import AlgoConfig, EvalConfig, RewardConfig, RolloutConfig
from miles_core.data.source import Prompt
from miles_core.models.tiny import encode_prompt
from miles_core.plugins import plugin
from miles_core.rollout.base import RolloutEngine, SamplingParams
from miles_core.samples import Sample
from miles_core.train.base import Trainer, pack

Group = list[Sample]  # the n samples of one prompt


def rollout(engine: RolloutEngine, source, tokenizer, cfg: RolloutConfig, scorer, buffer: list[Group], seed: int) -> tuple[list[Sample], list[Group], dict]:
    """Plug-point `rollout.rollout_fn`: one step's batch of cfg.prompts_per_step groups.

    Takes groups left in `buffer` first (rollout.buffer_filter_fn), then generates rounds of new
    prompts from `source` (its `next_batch(n)`) with rollout.generate_fn. With dynamic sampling,
    `scorer(samples)` fills the rewards of each round and rollout.dynamic_filter_fn drops groups,
    until the batch is full or cfg.max_rounds rounds ran. Returns (samples, leftover groups,
    metrics); the leftover groups are the next step's buffer.
    """
    params = SamplingParams(
        n=cfg.n_samples, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        max_new_tokens=cfg.max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,), seed=seed,
    )
    generate_fn, drop_reason = generate_fn_of(cfg), plugin(cfg, "rollout", "dynamic_filter_fn")
    groups, buffer = plugin(cfg, "rollout", "buffer_filter_fn")(buffer, cfg.prompts_per_step)
    taken, dropped, rounds, round_metrics, generated = len(groups), Counter(), [], [], 0
    while len(groups) < cfg.prompts_per_step and len(rounds) < cfg.max_rounds:
        prompts = source.next_batch(math.ceil((cfg.prompts_per_step - len(groups)) * cfg.over_sample))
        samples, metrics = generate_fn(engine, prompts, tokenizer, dataclasses.replace(params, seed=seed + 7919 * len(rounds)))
        round_metrics.append(metrics)
        generated += len(samples)
        last_round = [samples[i : i + cfg.n_samples] for i in range(0, len(samples), cfg.n_samples)]
        if cfg.dynamic_sampling:
            scorer(samples)
            reasons = [drop_reason(g) for g in last_round]
            dropped.update(r for r in reasons if r)
            last_round = [g for g, r in zip(last_round, reasons) if not r]
        groups += last_round
        rounds.append(len(last_round))
    if not groups:  # every group filtered out up to the cap: train on the last round rather than nothing,
        # but keep none of its dropped groups for later, where they would bypass the filter
        groups = [samples[i : i + cfg.n_samples] for i in range(0, len(samples), cfg.n_samples)][: cfg.prompts_per_step]
    batch, buffer = groups[: cfg.prompts_per_step], buffer + groups[cfg.prompts_per_step :]
    metrics = {k: sum(m[k] for m in round_metrics) / len(round_metrics) for k in round_metrics[0]} if round_metrics else {}
    metrics.update({
        "time/rollout_s": sum(m.get("time/rollout_s", 0.0) for m in round_metrics),
        "rollout/rounds": float(len(rounds)),
        "rollout/generated_samples": float(generated),
        "rollout/buffer_taken_groups": float(taken),
        "rollout/buffer_groups": float(len(buffer)),
        "rollout/batch_groups": float(len(batch)),
        "rollout/dropped_groups": float(sum(dropped.values())),
        **{f"rollout/dropped_{reason}": float(count) for reason, count in dropped.items()},
    })
    return [s for g in batch for s in g], buffer, metrics


def _given(fn, keyword: str, section):
    """fn with its config section bound when it declares the keyword parameter, else fn."""
    return functools.partial(fn, **{keyword: section}) if keyword in inspect.signature(fn).parameters else fn


def generate_fn_of(cfg: RolloutConfig):
    """rollout.generate_fn, given the rollout section when it takes `rollout_cfg` (e.g. multi-turn settings)."""
    return _given(plugin(cfg, "rollout", "generate_fn"), "rollout_cfg", cfg)


def reward_fn_of(cfg: RewardConfig):
    """reward.fn, given the reward section when it takes `reward_cfg` (e.g. the remote reward model's URL)."""
    return _given(plugin(cfg, "reward", "fn"), "reward_cfg", cfg)


def generate(engine: RolloutEngine, prompts: list[Prompt], tokenizer, params: SamplingParams) -> tuple[list[Sample], dict]:
    """Plug-point `rollout.generate_fn`: single-turn generation.

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
    """Fill the rewards of the groups not scored yet (reward.group_fn, then reward.post_fn).

    A reward that fails or is not finite scores cfg.fallback, is recorded in the sample's
    metadata["reward_error"] and counted: a reward bug must not lose the rollout.
    """
    started = time.perf_counter()
    group_fn, post_fn = plugin(cfg, "reward", "group_fn"), plugin(cfg, "reward", "post_fn")
    errors: dict[str, str] = {}

    def guarded(response: str, label: str, metadata: dict) -> float:
        try:
            return float(reward_fn(response, label, metadata))
        except Exception as err:  # recorded per response below
            errors[response] = f"{type(err).__name__}: {err}"[:300]
            return math.nan

    fresh: list[Sample] = []
    failures = 0
    for start in range(0, len(samples), group_size):
        group = samples[start : start + group_size]
        if not any(math.isnan(s.reward) for s in group):
            continue  # scored in an earlier round (dynamic sampling) or an earlier step (buffer)
        texts = [tokenizer.decode(s.response_tokens, skip_special_tokens=True) for s in group]
        try:
            rewards = [float(r) for r in group_fn(guarded, texts, group[0].label, group[0].metadata)]
            if len(rewards) != len(group):
                raise ValueError(f"returned {len(rewards)} rewards for {len(group)} responses")
        except Exception as err:  # the group function itself failed: the whole group scores cfg.min
            rewards = [math.nan] * len(group)
            errors.update({t: f"reward.group_fn: {type(err).__name__}: {err}"[:300] for t in texts})
        for s, text, r in zip(group, texts, rewards):
            if not math.isfinite(r):
                s.metadata = {**s.metadata, "reward_error": errors.get(text, f"reward is not finite ({r})")}
                r, failures = cfg.fallback, failures + 1
            s.reward = r
        fresh += group
    post_fn(fresh, group_size)
    for s in fresh:
        s.reward = min(max(s.reward, cfg.min), cfg.max)
    rewards = torch.tensor([s.reward for s in samples]).view(-1, group_size)  # [G, n]
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/accuracy": float((rewards >= cfg.max).float().mean()),
        "reward/zero_std_group_fraction": float((rewards.std(dim=1) == 0).float().mean()) if group_size > 1 else 1.0,
        "reward/failures": float(failures),
        "time/score_s": time.perf_counter() - started,
    }


def train(trainer: Trainer, samples: list[Sample], algo: AlgoConfig, group_size: int, temperature: float, pad_id: int,
          reference: Trainer | None = None, critic: Trainer | None = None, horizon: int = 1, train_policy: bool = True) -> dict:
    """One RL step on a scored batch: old log-probs, advantages, then the critic's and the policy's updates."""
    started = time.perf_counter()
    keep = plugin(algo, "algo", "sample_filter_fn")
    kept = [keep(s) for s in samples]
    samples = [s if k else dataclasses.replace(s, loss_mask=[0] * len(s.loss_mask)) for s, k in zip(samples, kept)]
    batch = pack(samples, pad_id)
    current = trainer.logprobs(batch, temperature)  # [B, T] policy before this step's updates
    metrics = mismatch_metrics(current, batch.rollout_logprobs, batch.loss_mask)
    old_logprobs = batch.rollout_logprobs if algo.use_rollout_logprobs else current
    extras = {"old_logprobs": old_logprobs}
    if algo.is_correction != "none":
        extras["is_weights"], is_metrics = plugin(algo, "algo", "is_correction_fn")(algo, current, batch.rollout_logprobs, batch.loss_mask)
        metrics.update(is_metrics)
    if algo.kl_coef > 0:
        extras["ref_logprobs"] = reference.logprobs(batch, temperature)
    kl = kl_penalty(old_logprobs, extras["ref_logprobs"], algo.kl_type) if algo.kl_in_reward else None  # [B, T]
    values = critic.logprobs(batch, temperature) if critic is not None else None  # [B, T] the critic's V(s_t)
    rewards = torch.tensor([s.reward for s in samples])  # [B]
    extras["advantages"], returns = plugin(algo, "algo", "advantage_fn")(algo, rewards, batch.response_mask, group_size, kl, values)
    weights_fn = functools.partial(loss_weights, mode=algo.loss_aggregation, horizon=algo.aggregation_horizon or horizon)
    if critic is not None:
        critic_metrics = critic.train_on(batch, {"old_values": values, "returns": returns}, functools.partial(critic_loss, algo), temperature, weights_fn=weights_fn)
        metrics.update({k.replace("train/", "critic/"): v for k, v in critic_metrics.items()})
    if train_policy:
        metrics.update(trainer.train_on(batch, extras, functools.partial(plugin(algo, "algo", "loss_fn"), algo), temperature, weights_fn=weights_fn))
    metrics["train/filtered_samples"] = float(len(kept) - sum(kept))
    metrics["time/train_s"] = time.perf_counter() - started
    return metrics


def evaluate(engine: RolloutEngine, prompts: list[Prompt], tokenizer, reward_fn, reward: RewardConfig, cfg: EvalConfig, generate_fn=generate) -> dict:
    """Plug-point `evaluation.fn`: greedy accuracy on held-out prompts.

    `generate_fn` is the run's rollout.generate_fn (e.g. multi-turn with tools).
    Returns {"eval/accuracy", "eval/reward", "eval/prompts"}.
    """
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    samples, _ = generate_fn(engine, prompts, tokenizer, params)
    scored = score(samples, reward_fn, tokenizer, reward, group_size=1)
    return {"eval/accuracy": scored["reward/accuracy"], "eval/reward": scored["reward/mean"], "eval/prompts": float(len(prompts))}
