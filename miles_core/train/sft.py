"""Supervised warm start: cross-entropy on the demonstrations' response tokens only.

A prompt's demonstrations are `metadata["demonstrations"]` (a list of responses, e.g. the problem
set's imperfect teacher's attempts) when the data carries them, else its label.  Linear warm-up then cosine decay.
A demonstration is either a response text or a multi-turn conversation (a list of assistant/tool
messages, e.g. a tool call, the tool's output, the answer): its tool turns are masked out of the loss.
"""

from __future__ import annotations

import math
import random
import time

from tqdm import tqdm

from miles_core.algos.objective import sft_loss
from miles_core.chat import conversation_tokens, prompt_tokens, response_tokens
from miles_core.config import SFTConfig, TrainConfig
from miles_core.data.source import Prompt
from miles_core.samples import Sample
from miles_core.train.base import Trainer, pack


def demonstrations(prompts: list[Prompt], tokenizer) -> list[Sample]:
    out = []
    for p in prompts:
        prompt = prompt_tokens(tokenizer, p.text)
        for i, demo in enumerate(p.metadata.get("demonstrations", [p.label])):
            if isinstance(demo, list):
                response, mask = conversation_tokens(tokenizer, demo)
            else:
                response = response_tokens(tokenizer, str(demo))
                mask = [1] * len(response)
            out.append(
                Sample(
                    prompt_id=p.id,
                    index=i,
                    prompt_tokens=prompt,
                    response_tokens=response,
                    rollout_logprobs=[0.0] * len(response),
                    loss_mask=mask,
                    finish_reason="stop",
                    weight_version=0,
                    label=p.label,
                    metadata=p.metadata,
                )
            )
    return out


def sft_train_config(cfg: SFTConfig) -> TrainConfig:
    return TrainConfig(lr=cfg.lr, micro_batch_size=cfg.batch_size, seed=cfg.seed)


def lr_at(step: int, cfg: SFTConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def run_sft(trainer: Trainer, samples: list[Sample], cfg: SFTConfig, pad_id: int, deadline: float | None = None) -> dict:
    """cfg.steps optimizer steps on seeded random batches (fewer if time.monotonic() passes deadline)."""
    rng = random.Random(cfg.seed)
    metrics: dict = {}
    for step in tqdm(range(cfg.steps), desc="sft", unit="step", mininterval=2):
        if deadline is not None and time.monotonic() > deadline:
            break
        batch = pack([samples[i] for i in rng.sample(range(len(samples)), min(cfg.batch_size, len(samples)))], pad_id)
        metrics = trainer.train_on(batch, {}, sft_loss, temperature=1.0, lr=lr_at(step, cfg))
    return {k.replace("train/", "sft/"): v for k, v in metrics.items()}
