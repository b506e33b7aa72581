"""The RL step, written once: generate -> score -> filter -> advantages -> train -> publish.

    fns = bind(rollout=..., reward=..., algo=..., hooks=..., evaluation=...)  # every plug-point, resolved once
    samples, buffer, m = fns.rollout_fn(engine, source, tokenizer, fns, scorer_of(fns, tokenizer), buffer, seed)
    m |= score_batch(samples, fns, tokenizer, iteration)                       # reward.group_fn/post_fn, rollout_log
    (distill.teacher: distill.score_with_teacher fills each sample's teacher log-probs; sync: its own task, tasks/distill.py)
    m |= train_step(trainer, samples, fns, pad_id, reference, critic, iteration)  # old log-probs, advantages, updates
    publish (weights/publish.py: a versioned HF directory; in the async phase: a push to the engines)

`run_step` is exactly that sequence in one process. The sync tasks run its stages as separate
Flyte tasks and the async phase's actors run them in Ray actors, always over the same `StepFns`
built by `bind` from the config sections, so every setting means the same in both modes.
`rollout`, `generate` and `evaluate` are the defaults of their plug-points (signatures in their
docstrings and in `miles_core.plugins.PLUGPOINTS`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import time
from collections import Counter
from collections.abc import Callable

import torch

from miles_core import health
from miles_core.algos.corrections import mismatch_metrics
from miles_core.algos.distill import with_teacher
from miles_core.algos.kl import kl_penalty
from miles_core.algos.losses import loss_weights
from miles_core.algos.objective import critic_loss
from miles_core.chat import prompt_tokens
from miles_core.config import AlgoConfig, DistillConfig, EvalConfig, HealthConfig, HooksConfig, RewardConfig, RolloutConfig
from miles_core.data.source import Prompt
from miles_core.plugins import plugin
from miles_core.rewards.base import Response
from miles_core.rewards.hub import batched
from miles_core.rewards.remote import RemoteRewardUnavailable
from miles_core.rollout.base import RolloutEngine, SamplingParams
from miles_core.rollout.speculative import acceptance_metrics
from miles_core.samples import Sample, sample_id_of
from miles_core.train.base import Trainer, pack

Group = list[Sample]  # the n samples of one prompt
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepFns:
    """The config sections a step reads and every plug-point, resolved from them once (`bind`)."""

    rollout: RolloutConfig
    reward: RewardConfig
    algo: AlgoConfig
    hooks: HooksConfig
    evaluation: EvalConfig
    health: HealthConfig
    distill: DistillConfig
    rollout_fn: Callable
    generate_fn: Callable  # with rollout_cfg bound when it takes it (e.g. multi-turn settings)
    dynamic_filter_fn: Callable
    buffer_filter_fn: Callable
    reward_fn: Callable  # with reward_cfg bound when it takes it (e.g. the remote reward model's URL)
    group_fn: Callable
    post_fn: Callable
    advantage_fn: Callable
    loss_fn: Callable
    is_correction_fn: Callable
    sample_filter_fn: Callable
    before_train_step: Callable
    after_train_step: Callable
    after_save: Callable
    rollout_log: Callable
    evaluate_fn: Callable


def _given(fn, keyword: str, section):
    """fn with its config section bound when it declares the keyword parameter, else fn."""
    return functools.partial(fn, **{keyword: section}) if keyword in inspect.signature(fn).parameters else fn


def bind(
    rollout: RolloutConfig = RolloutConfig(),
    reward: RewardConfig = RewardConfig(),
    algo: AlgoConfig = AlgoConfig(),  # noqa: B008 (frozen)
    hooks: HooksConfig = HooksConfig(),
    evaluation: EvalConfig = EvalConfig(),
    health: HealthConfig = HealthConfig(),
    distill: DistillConfig = DistillConfig(),
) -> StepFns:  # noqa: B008 (frozen dataclasses)
    """Resolve every plug-point of the step from its config sections (a bad path fails here, naming its field)."""
    sections = {"rollout": rollout, "reward": reward, "algo": algo, "hooks": hooks}
    resolved = {name: plugin(cfg, section, name) for section, cfg in sections.items() for name in _PLUGPOINTS_OF[section]}
    resolved["generate_fn"] = _given(resolved["generate_fn"], "rollout_cfg", rollout)
    resolved["reward_fn"] = _given(plugin(reward, "reward", "fn"), "reward_cfg", reward)
    return StepFns(**sections, evaluation=evaluation, health=health, distill=distill, evaluate_fn=plugin(evaluation, "evaluation", "fn"), **resolved)


_PLUGPOINTS_OF = {
    "rollout": ("rollout_fn", "generate_fn", "dynamic_filter_fn", "buffer_filter_fn"),
    "reward": ("group_fn", "post_fn"),
    "algo": ("advantage_fn", "loss_fn", "is_correction_fn", "sample_filter_fn"),
    "hooks": ("before_train_step", "after_train_step", "after_save", "rollout_log"),
}


def sampling_params(cfg: RolloutConfig, tokenizer, seed: int, max_new_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(
        n=cfg.n_samples,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=max_new_tokens or cfg.max_new_tokens,
        stop_token_ids=(tokenizer.eos_token_id,),
        seed=seed,
    )


def rollout_seed(cfg: RolloutConfig, position: int) -> int:
    """The seed of the rollout at `position` (the sync iteration, or an async lease's first draw)."""
    return cfg.seed * 1_000_003 + position


def groups_of(samples: list[Sample], n: int) -> list[Group]:
    return [samples[i : i + n] for i in range(0, len(samples), n)]


def run_step(
    engine: RolloutEngine,
    source,
    tokenizer,
    fns: StepFns,
    trainer: Trainer,
    buffer: list[Group],
    iteration: int,
    reference: Trainer | None = None,
    critic: Trainer | None = None,
) -> tuple[list[Sample], list[Group], dict]:
    """One whole RL step in this process (publishing is the caller's: it owns where weights go)."""
    samples, buffer, metrics = fns.rollout_fn(engine, source, tokenizer, fns, scorer_of(fns, tokenizer), buffer, rollout_seed(fns.rollout, iteration))
    metrics.update(score_batch(samples, fns, tokenizer, iteration, metrics))
    metrics.update(train_step(trainer, samples, fns, tokenizer.pad_token_id, reference, critic, iteration))
    return samples, buffer, metrics


def rollout(engine: RolloutEngine, source, tokenizer, fns: StepFns, scorer, buffer: list[Group], seed: int) -> tuple[list[Sample], list[Group], dict]:
    """Plug-point `rollout.rollout_fn`: one batch of fns.rollout.prompts_per_step groups.

    Takes groups left in `buffer` first (fns.buffer_filter_fn), then generates rounds of new
    prompts from `source` (its `next_batch(n)`) with fns.generate_fn. With dynamic sampling,
    `scorer(samples)` fills the rewards of each round and fns.dynamic_filter_fn drops groups,
    until the batch is full or cfg.max_rounds rounds ran. Returns (samples, leftover groups,
    metrics); the leftover groups are the next step's buffer. Metrics count every group drawn,
    kept and dropped (rollout/drawn_groups = batch + leftover + dropped).
    """
    cfg = fns.rollout
    params = sampling_params(cfg, tokenizer, seed)
    groups, buffer = fns.buffer_filter_fn(buffer, cfg.prompts_per_step)
    taken, dropped, rounds, round_metrics, generated, samples = len(groups), Counter(), [], [], 0, []
    while len(groups) < cfg.prompts_per_step and len(rounds) < cfg.max_rounds:
        prompts = source.next_batch(math.ceil((cfg.prompts_per_step - len(groups)) * cfg.over_sample))
        if not prompts:
            break
        samples, metrics = fns.generate_fn(engine, prompts, tokenizer, dataclasses.replace(params, seed=seed + 7919 * len(rounds)))
        round_metrics.append(metrics)
        generated += len(samples)
        last_round = groups_of(samples, cfg.n_samples)
        if cfg.dynamic_sampling:
            scorer(samples)
            reasons = [fns.dynamic_filter_fn(g) for g in last_round]
            dropped.update(r for r in reasons if r)
            last_round = [g for g, r in zip(last_round, reasons) if not r]
        groups += last_round
        rounds.append(len(last_round))
    if not groups and len(rounds) == cfg.max_rounds:  # every group filtered out up to the cap: train on the last round
        # rather than nothing, but keep none of its dropped groups for later, where they would bypass the filter
        # (a source that runs dry first, e.g. an async lease, yields an empty batch)
        groups = groups_of(samples, cfg.n_samples)[: cfg.prompts_per_step]
    batch, buffer = groups[: cfg.prompts_per_step], buffer + groups[cfg.prompts_per_step :]
    metrics = {k: sum(m[k] for m in round_metrics) / len(round_metrics) for k in round_metrics[0]} if round_metrics else {}
    metrics.update(
        {
            "time/rollout_s": sum(m.get("time/rollout_s", 0.0) for m in round_metrics),
            "rollout/rounds": float(len(rounds)),
            "rollout/generated_samples": float(generated),
            "rollout/buffer_taken_groups": float(taken),
            "rollout/buffer_groups": float(len(buffer)),
            "rollout/batch_groups": float(len(batch)),
            "rollout/dropped_groups": float(sum(dropped.values())),
            **{f"rollout/dropped_{reason}": float(count) for reason, count in dropped.items()},
        }
    )
    return [s for g in batch for s in g], buffer, metrics


def generate(engine: RolloutEngine, prompts: list[Prompt], tokenizer, params: SamplingParams) -> tuple[list[Sample], dict]:
    """Plug-point `rollout.generate_fn`: single-turn generation.

    Returns params.n samples per prompt, grouped by prompt (prompt-major, sample index minor),
    each with prompt/response token ids as generated, rollout log-probs and loss mask, plus
    rollout metrics {name: float}.
    """
    started = time.perf_counter()
    prompt_ids = [prompt_tokens(tokenizer, p.text) for p in prompts]
    groups = engine.generate(prompt_ids, params)
    samples = [
        Sample(
            prompt_id=p.id,
            index=i,
            prompt_tokens=tokens,
            response_tokens=g.tokens,
            rollout_logprobs=g.logprobs,
            loss_mask=[1] * len(g.tokens),
            finish_reason=g.finish_reason,
            weight_version=g.weight_version,
            label=p.label,
            metadata=p.metadata,
            routed_experts=g.routed_experts,
        )
        for p, tokens, group in zip(prompts, prompt_ids, groups)
        for i, g in enumerate(group)
    ]
    seconds = time.perf_counter() - started
    lengths = [len(s.response_tokens) for s in samples]
    return samples, {
        "rollout/response_length": sum(lengths) / len(lengths),
        "rollout/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "rollout/tokens_per_s": sum(lengths) / seconds,
        "time/rollout_s": seconds,
        **acceptance_metrics(groups),
    }


def scorer_of(fns: StepFns, tokenizer, group_size: int | None = None) -> Callable[[list[Sample]], dict]:
    """score(samples) with the step's reward functions: what a rollout_fn calls for dynamic sampling."""
    return functools.partial(score, fns=fns, tokenizer=tokenizer, group_size=group_size)


def score(samples: list[Sample], fns: StepFns, tokenizer, group_size: int | None = None) -> dict:
    """Fill the rewards of the groups not scored yet (fns.group_fn, then fns.post_fn), each sample
    against its own label and metadata; groups of group_size (default rollout.n_samples).

    A reward that fails or is not finite scores reward.fallback, is recorded in the sample's
    metadata["reward_error"] and counted: a reward bug must not lose the rollout. An unreachable
    remote reward model (`RemoteRewardUnavailable`: its circuit breaker is open) fails the step
    instead. A reward outside [reward.min, reward.max] after post_fn is clamped with a warning
    naming the sample and counted (`reward/out_of_range`), as the remote client's `clamp` policy does.
    """
    started, cfg, n = time.perf_counter(), fns.reward, group_size or fns.rollout.n_samples
    pending = [g for g in groups_of(samples, n) if any(math.isnan(s.reward) for s in g)]  # others: scored in an earlier round or step
    responses = [[Response(tokenizer.decode(s.response_tokens, skip_special_tokens=True), s.label, s.metadata) for s in g] for g in pending]
    reward_fn = batched(fns.reward_fn, [r for group in responses for r in group], cfg)  # remote: the batch at once, one deadline
    errors: dict[str, str] = {}  # response text -> why its reward failed

    def guarded(response: str, label: str, metadata: dict) -> float:
        try:
            return float(reward_fn(response, label, metadata))
        except RemoteRewardUnavailable:
            raise
        except Exception as err:  # noqa: BLE001 (any reward bug is recorded per response below)
            errors[response] = f"{type(err).__name__}: {err}"[:300]
            return math.nan

    failures = 0
    for group, group_responses in zip(pending, responses):
        try:
            rewards = [float(r) for r in fns.group_fn(guarded, group_responses)]
            if len(rewards) != len(group):
                raise ValueError(f"returned {len(rewards)} rewards for {len(group)} responses")
        except RemoteRewardUnavailable:
            raise
        except Exception as err:  # noqa: BLE001 (the group function itself failed: the whole group scores the fallback)
            rewards = [math.nan] * len(group)
            errors.update({r.text: f"reward.group_fn: {type(err).__name__}: {err}"[:300] for r in group_responses})
        for s, response, r in zip(group, group_responses, rewards):
            if not math.isfinite(r):
                s.metadata = {**s.metadata, "reward_error": errors.get(response.text, f"reward is not finite ({r})")}
                r, failures = cfg.fallback, failures + 1
            s.reward = r
    fresh = [s for g in pending for s in g]
    fns.post_fn(fresh, n)
    out_of_range = clamp_rewards(fresh, cfg)
    rewards = torch.tensor([s.reward for s in samples]).view(-1, n)  # [G, n]
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/accuracy": float((rewards >= cfg.max).float().mean()),
        "reward/zero_std_group_fraction": float((rewards.std(dim=1) == 0).float().mean()) if n > 1 else 1.0,
        "reward/failures": float(failures),
        "reward/out_of_range": float(out_of_range),
        "time/score_s": time.perf_counter() - started,
    }


def clamp_rewards(samples: list[Sample], cfg: RewardConfig) -> int:
    """Clamp every reward into [cfg.min, cfg.max], never silently: warns naming the samples; returns how many were out."""
    out = [s for s in samples if not cfg.min <= s.reward <= cfg.max]
    if out:
        named = ", ".join(f"{sample_id_of(s.prompt_id, s.index)}={s.reward}" for s in out[:8])
        log.warning(
            "%d reward(s) outside [reward.min, reward.max] = [%s, %s] after reward.post_fn, clamped: %s%s",
            len(out),
            cfg.min,
            cfg.max,
            named,
            ", ..." if len(out) > 8 else "",
        )
    for s in out:
        s.reward = min(max(s.reward, cfg.min), cfg.max)
    return len(out)


def score_batch(samples: list[Sample], fns: StepFns, tokenizer, iteration: int, rollout_metrics: dict | None = None) -> dict:
    """The score stage: rewards of the batch (those not scored during rollout) and the rollout_log hook's metrics."""
    metrics = score(samples, fns, tokenizer)
    metrics.update(fns.rollout_log(samples, {**(rollout_metrics or {}), **metrics}, iteration))
    return metrics


def train_step(
    trainer: Trainer,
    samples: list[Sample],
    fns: StepFns,
    pad_id: int,
    reference: Trainer | None = None,
    critic: Trainer | None = None,
    iteration: int = 0,
    trace: dict | None = None,
) -> dict:
    """The train stage between the before/after train-step hooks, checked by the health gates; PPO's critic trains alone
    for its warm-up iterations. `trace`, when given, receives the step's per-token tensors (`optimize`)."""
    fns.before_train_step(trainer, samples, iteration)
    train_policy = critic is None or iteration >= fns.algo.critic_warmup_steps
    metrics = optimize(trainer, samples, fns, pad_id, reference, critic, train_policy, trace)
    metrics.update(health.check(fns.health, metrics, samples))
    fns.after_train_step(trainer, metrics, iteration)
    return metrics


def optimize(
    trainer: Trainer,
    samples: list[Sample],
    fns: StepFns,
    pad_id: int,
    reference: Trainer | None = None,
    critic: Trainer | None = None,
    train_policy: bool = True,
    trace: dict | None = None,
) -> dict:
    """One RL update on a scored batch: old log-probs, advantages, then the critic's and the policy's updates.
    `trace`, when given, receives "trainer_logprobs" and "advantages" [B, T] (the readable dump, miles_core/dump.py)."""
    started, algo, cfg = time.perf_counter(), fns.algo, fns.rollout
    kept = [fns.sample_filter_fn(s) for s in samples]
    samples = [s if k else dataclasses.replace(s, loss_mask=[0] * len(s.loss_mask)) for s, k in zip(samples, kept)]
    batch = pack(samples, pad_id)
    current = trainer.logprobs(batch, cfg.temperature)  # [B, T] policy before this step's updates
    metrics = mismatch_metrics(current, batch.rollout_logprobs, batch.loss_mask, algo.log_ratio_clamp, algo.mismatch_threshold)
    metrics.update(trainer.routing_metrics())  # R3: how often the trainer's routers agree with the replayed rollout's
    old_logprobs = batch.rollout_logprobs if algo.use_rollout_logprobs else current
    extras = {"old_logprobs": old_logprobs}
    if algo.is_correction != "none":
        extras["is_weights"], is_metrics = fns.is_correction_fn(algo, current, batch.rollout_logprobs, batch.loss_mask)
        metrics.update(is_metrics)
    if algo.kl_coef > 0:
        extras["ref_logprobs"] = reference.logprobs(batch, cfg.temperature)
    kl = kl_penalty(old_logprobs, extras["ref_logprobs"], algo.kl_type, log_ratio_clamp=algo.log_ratio_clamp) if algo.kl_in_reward else None  # [B, T]
    values = critic.logprobs(batch, cfg.temperature) if critic is not None else None  # [B, T] the critic's V(s_t)
    rewards = torch.tensor([s.reward for s in samples])  # [B]
    extras["advantages"], returns = fns.advantage_fn(algo, rewards, batch.loss_mask, cfg.n_samples, kl, values)  # holes (tool output) are no steps
    if fns.distill.teacher:  # on-policy distillation: the teacher's log-probs of the sampled tokens (its stage stored them)
        extras["advantages"], distilled = with_teacher(fns.distill, extras["advantages"], old_logprobs, batch.teacher_logprobs, batch.loss_mask, algo.gamma)
        metrics.update(distilled)
    if trace is not None:
        trace.update(trainer_logprobs=current, advantages=extras["advantages"])
    weights_fn = functools.partial(loss_weights, mode=algo.loss_aggregation, horizon=algo.aggregation_horizon or cfg.max_new_tokens)
    if critic is not None:
        critic_metrics = critic.train_on(
            batch, {"old_values": values, "returns": returns}, functools.partial(critic_loss, algo), cfg.temperature, weights_fn=weights_fn
        )
        metrics.update({k.replace("train/", "critic/"): v for k, v in critic_metrics.items()})
    if train_policy:
        metrics.update(trainer.train_on(batch, extras, functools.partial(fns.loss_fn, algo), cfg.temperature, weights_fn=weights_fn))
    metrics["train/filtered_samples"] = float(len(kept) - sum(kept))
    metrics["time/train_s"] = time.perf_counter() - started
    return metrics


def evaluate(engine: RolloutEngine, prompts: list[Prompt], tokenizer, fns: StepFns) -> dict:
    """Plug-point `evaluation.fn`: greedy accuracy on held-out prompts, generated with the run's
    fns.generate_fn (e.g. multi-turn with tools) and scored with its reward functions.
    Returns {"eval/accuracy", "eval/reward", "eval/prompts"}.
    """
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=fns.evaluation.max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    samples, _ = fns.generate_fn(engine, prompts, tokenizer, params)
    scored = score(samples, fns, tokenizer, group_size=1)
    return {"eval/accuracy": scored["reward/accuracy"], "eval/reward": scored["reward/mean"], "eval/prompts": float(len(prompts))}
