"""Partial rollout for the async phase: generation in segments, so a weight update lands between them and a
response continues under the newer weights (miles_core/async_loop.py `lease_fns`)."""

from __future__ import annotations

import dataclasses

from miles_core.config import AsyncConfig, RolloutConfig
from miles_core.data.source import Prompt
from miles_core.rollout.base import SamplingParams
from miles_core.samples import Sample


def generate_segmented(
    engine, prompts: list[Prompt], tokenizer, params: SamplingParams, *, generate_fn, rollout: RolloutConfig, cfg: AsyncConfig
) -> tuple[list[Sample], dict]:
    """`rollout.generate_fn` in segments (partial rollout): each engine call generates at most
    cfg.partial_segment_tokens tokens, and a weight update may land between calls, so a response
    continues under the newer weights. Each sample's weight_version is the oldest policy among the
    tokens it trains on; with cfg.mask_stale_tokens older tokens get loss mask 0."""
    params = dataclasses.replace(params, max_new_tokens=min(cfg.partial_segment_tokens, rollout.max_new_tokens))
    samples, metrics = generate_fn(engine, prompts, tokenizer, params)
    versions = [[s.weight_version] * len(s.response_tokens) for s in samples]  # per response token
    for round_ in range(1, rollout.max_new_tokens):
        open_ = [i for i, s in enumerate(samples) if s.finish_reason == "length" and len(s.response_tokens) < rollout.max_new_tokens]
        if not open_:
            break
        left = rollout.max_new_tokens - len(samples[open_[0]].response_tokens)  # open samples share one length
        segment = dataclasses.replace(params, n=1, max_new_tokens=min(params.max_new_tokens, left), seed=params.seed + 7919 * round_)
        generations = engine.generate([samples[i].prompt_tokens + samples[i].response_tokens for i in open_], segment)
        for i, (g,) in zip(open_, generations):
            s = samples[i]
            s.response_tokens, s.rollout_logprobs = s.response_tokens + g.tokens, s.rollout_logprobs + g.logprobs
            s.loss_mask, s.finish_reason = s.loss_mask + [1] * len(g.tokens), g.finish_reason
            s.routed_experts = g.routed_experts  # the continuation fed the whole sample: its routing covers every position
            versions[i] += [g.weight_version] * len(g.tokens)
    return [_versioned(s, v, cfg.mask_stale_tokens) for s, v in zip(samples, versions)], metrics


def _versioned(sample: Sample, versions: list[int], mask_stale: bool) -> Sample:
    if mask_stale:
        sample.loss_mask = [m if v == versions[-1] else 0 for m, v in zip(sample.loss_mask, versions)]
    trained = [v for v, m in zip(versions, sample.loss_mask) if m] or versions
    sample.weight_version = min(trained)
    if len(set(versions)) > 1:
        sample.metadata = {**sample.metadata, "token_versions": versions}
    return sample
