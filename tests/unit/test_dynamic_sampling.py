"""DAPO dynamic sampling through `step.rollout` with the real torch engine on a tiny model.

The reward is chosen per prompt so the test knows which groups the default filter must drop:
prompts with an even number score the same for every sample (zero std: dropped), odd ones
score by sample index (kept).
"""

import dataclasses
import math

import pytest
from transformers import AutoTokenizer

from miles_core import step
from miles_core.config import ModelConfig, RolloutConfig
from miles_core.data.source import Prompt, PromptSource
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.engines.torch_engine import TorchEngine

N = 2  # samples per prompt


@pytest.fixture(scope="module")
def engine_and_tokenizer(tmp_path_factory):
    model_dir = build_tiny_model(
        ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64), tmp_path_factory.mktemp("m") / "model"
    )
    return TorchEngine(model_dir, 3), AutoTokenizer.from_pretrained(model_dir)


def score_by_prompt(samples):
    for s in samples:
        s.reward = float(s.index) if int(s.prompt_id) % 2 else 1.0


def numbered(ids):
    return PromptSource([Prompt(str(i), f"{i}+1=", str(i + 1)) for i in ids], seed=0)


def run(engine_and_tokenizer, cfg, buffer=(), source=None):
    engine, tokenizer = engine_and_tokenizer
    source = source or numbered(range(40))
    samples, left, metrics = step.rollout(engine, source, tokenizer, step.bind(rollout=cfg), score_by_prompt, list(buffer), seed=1)
    return samples, left, metrics, source


CFG = RolloutConfig(prompts_per_step=4, n_samples=N, max_new_tokens=2, dynamic_sampling=True, over_sample=2.0, max_rounds=4)


def test_only_groups_with_reward_variance_fill_the_batch(engine_and_tokenizer):
    samples, left, metrics, _ = run(engine_and_tokenizer, CFG)
    # what the rounds must be: each asks over_sample x the missing groups of the source's order
    order, kept, dropped, rounds = [p.id for p in numbered(range(40)).next_batch(40)], [], [], 0
    while len(kept) < 4:
        asked, order = order[: math.ceil((4 - len(kept)) * CFG.over_sample)], order[math.ceil((4 - len(kept)) * CFG.over_sample) :]
        kept += [i for i in asked if int(i) % 2]
        dropped += [i for i in asked if not int(i) % 2]
        rounds += 1
    groups = [samples[i : i + N] for i in range(0, len(samples), N)]
    assert [g[0].prompt_id for g in groups] == kept[:4] and [g[0].prompt_id for g in left] == kept[4:]
    assert all([s.prompt_id for s in g] == [g[0].prompt_id] * N and [s.index for s in g] == [0, 1] for g in groups)
    assert metrics["rollout/rounds"] == rounds and metrics["rollout/batch_groups"] == 4
    assert metrics["rollout/dropped_groups"] == metrics["rollout/dropped_zero_std_reward_1"] == len(dropped)
    assert metrics["rollout/generated_samples"] == N * (len(kept) + len(dropped))


def test_leftover_groups_are_taken_first_in_the_next_step(engine_and_tokenizer):
    _, left, _, source = run(engine_and_tokenizer, CFG, source=numbered(range(1, 80, 2)))
    assert len(left) == 4  # every group passes: asking 2 x 4 prompts leaves 4 groups over
    samples, _, metrics, _ = run(engine_and_tokenizer, CFG, buffer=left, source=source)
    assert [s.prompt_id for s in samples[::N]] == [g[0].prompt_id for g in left]
    assert metrics["rollout/buffer_taken_groups"] == 4 and metrics["rollout/rounds"] == 0


def test_the_round_cap_bounds_generation(engine_and_tokenizer):
    only_even = numbered(range(0, 80, 2))  # every group is dropped
    cfg = dataclasses.replace(CFG, max_rounds=2)
    samples, left, metrics, _ = run(engine_and_tokenizer, cfg, source=only_even)
    assert metrics["rollout/rounds"] == 2 and metrics["rollout/dropped_groups"] == 8 + 8
    # nothing passed: the batch comes from the last round rather than nothing, and none of its
    # zero-advantage groups waits in the buffer to bypass the filter in the next step
    assert len(samples) == 4 * N and not left
