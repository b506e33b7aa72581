"""Partial rollout: generation in segments continues a response where it stopped, under whatever
weights the engine holds by then, with per-token versions and optional masking of older tokens.

The weight update between segments is simulated by bumping the engine's version (weights unchanged),
which is what a real update changes from the sampler's point of view; the real update path runs in
tests/integration/test_async_phase.py."""

import pytest
import torch
from transformers import AutoTokenizer

from miles_core.config import AsyncConfig, ModelConfig, RolloutConfig, TrainConfig
from miles_core.data.source import Prompt
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.rollout.partial import generate_segmented
from miles_core.step import generate, sampling_params
from miles_core.train.base import pack
from miles_core.train.torch_backend import TorchTrainer

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
ROLLOUT = RolloutConfig(n_samples=3, max_new_tokens=6)


class UpdatedBetweenCalls(TorchEngine):
    """Each generate call after the first runs as a newer weight version (an update landed in between)."""

    def generate(self, prompts, params):
        out = super().generate(prompts, params)
        self.weight_version += 1
        return out


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_model(TINY, str(tmp_path_factory.mktemp("m") / "base"))


def run(policy_dir, record_routing=False, **async_values):
    engine = UpdatedBetweenCalls(policy_dir, version=1, record_routing=record_routing)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    prompts = [Prompt(id=f"p{i}", text=f"{i}+{i}=", label=str(2 * i), metadata={"draw": i}) for i in range(4)]
    cfg = AsyncConfig(partial_rollout=True, partial_segment_tokens=2, **async_values)
    params = sampling_params(ROLLOUT, tokenizer, seed=0)
    samples, _ = generate_segmented(engine, prompts, tokenizer, params, generate_fn=generate, rollout=ROLLOUT, cfg=cfg)
    return samples, tokenizer


def test_continued_responses_carry_each_tokens_version(policy_dir):
    samples, tokenizer = run(policy_dir)
    full = [s for s in samples if len(s.response_tokens) == 6 and s.finish_reason == "length"]
    assert full, "a random tiny model should reach the length cap"
    for s in full:
        assert s.metadata["token_versions"] == [1, 1, 2, 2, 3, 3]
        assert s.weight_version == 1 and s.loss_mask == [1] * 6  # the oldest policy in the response
    for s in samples:
        assert len(s.response_tokens) == len(s.rollout_logprobs) == len(s.loss_mask) <= 6
        assert tokenizer.eos_token_id not in s.response_tokens[:-1]  # nothing generated after a stop


def test_masking_keeps_only_the_newest_policys_tokens(policy_dir):
    samples, _ = run(policy_dir, mask_stale_tokens=True)
    full = [s for s in samples if len(s.response_tokens) == 6 and s.finish_reason == "length"]
    assert full and all(s.loss_mask == [0, 0, 0, 0, 1, 1] and s.weight_version == 3 for s in full)


def test_continuation_log_probs_are_the_policys(policy_dir):
    """Re-prefilling prompt + partial response gives the same log-probs a trainer recomputes."""
    samples, tokenizer = run(policy_dir)
    batch = pack(samples, tokenizer.pad_token_id)
    recomputed = TorchTrainer.from_hf(policy_dir, TrainConfig()).logprobs(batch, temperature=1.0)
    assert torch.allclose(recomputed * batch.response_mask, batch.rollout_logprobs, atol=1e-4)


def test_a_continued_response_carries_the_routing_of_every_position(tmp_path):
    """R3 with partial rollout: the last segment's call fed prompt and response so far, so its routing covers every
    position; the trainer replaying it recomputes the engine's log-probs, its routers agreeing throughout."""
    moe = ModelConfig(arch="qwen3_moe", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, num_experts=4, moe_top_k=2, moe_intermediate_size=16)
    policy_dir = build_tiny_model(moe, str(tmp_path / "moe"))
    samples, tokenizer = run(policy_dir, record_routing=True)
    assert all(len(s.routed_experts) == (len(s.prompt_tokens) + len(s.response_tokens) - 1) * 2 * 2 for s in samples)
    trainer = TorchTrainer.from_hf(policy_dir, TrainConfig())
    batch = pack(samples, tokenizer.pad_token_id)
    assert torch.allclose(trainer.logprobs(batch, temperature=1.0) * batch.response_mask, batch.rollout_logprobs, atol=1e-4)
    assert trainer.routing_metrics() == {"routing/agreement": 1.0}
