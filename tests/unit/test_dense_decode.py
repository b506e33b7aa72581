"""The TorchEngine's dense decoder (miles_core/rollout/engines/dense_decode.py) against HF's forward, on tiny random
models of each family it covers, built here: the same tokens and log-probs from left-padded prompts of several lengths,
greedy and sampled, before and after new weights are loaded in place."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engines.dense_decode import covers
from miles_core.rollout.engines.torch_engine import TorchEngine

VOCAB = 96
PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27], [30], [40, 41, 42, 43, 44]]  # left-padded to 8
SIZE = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
SIZE |= {"intermediate_size": 96, "max_position_embeddings": 64, "initializer_range": 0.2}
FAMILIES = {
    "llama": lambda: LlamaConfig(**SIZE, attention_bias=True),  # biases on q, k, v and o
    "qwen2": lambda: Qwen2Config(**SIZE),  # biases on q, k, v
    "qwen3": lambda: Qwen3Config(**SIZE, head_dim=16),  # each head's query and key normalized
}
PARAMS = {
    "greedy": SamplingParams(n=2, temperature=0.0, max_new_tokens=12, stop_token_ids=[3], seed=0),
    "sampled": SamplingParams(n=3, temperature=1.0, max_new_tokens=12, stop_token_ids=[3], seed=7),
}


def build(path, config, seed: int) -> str:
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def both_ways(engine: TorchEngine, params: SamplingParams) -> tuple[list, list]:
    """The engine's generations through the dense decoder, then through HF's forward (the decoder set aside)."""
    dense = engine.generate(PROMPTS, params)
    decoder, engine.dense = engine.dense, None
    try:
        return dense, engine.generate(PROMPTS, params)
    finally:
        engine.dense = decoder


def assert_same(dense: list, hf: list) -> None:
    for dense_group, hf_group in zip(dense, hf):
        for ours, theirs in zip(dense_group, hf_group):
            assert ours.tokens == theirs.tokens and ours.finish_reason == theirs.finish_reason
            assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("how", PARAMS)
def test_the_dense_decoder_gives_hfs_tokens_and_logprobs(family, how, tmp_path):
    engine = TorchEngine(build(tmp_path / "policy", FAMILIES[family](), seed=0))
    assert engine.dense is not None
    dense, hf = both_ways(engine, PARAMS[how])
    assert {len(g.tokens) for group in dense for g in group} != {1}  # responses of several lengths, not all stopped at once
    assert_same(dense, hf)


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_loaded_in_place_are_the_ones_decoded(family, tmp_path):
    """A new policy version copied into the model built (and a state dict handed over) restacks the fused projections."""
    engine = TorchEngine(build(tmp_path / "v0", FAMILIES[family](), seed=0))
    before = engine.generate(PROMPTS, PARAMS["greedy"])
    engine.load_weights(build(tmp_path / "v1", FAMILIES[family](), seed=1), version=1)
    after, hf = both_ways(engine, PARAMS["greedy"])
    assert after != before
    assert_same(after, hf)
    engine.load_state_dict(AutoModelForCausalLM.from_pretrained(tmp_path / "v0").state_dict(), version=2)
    assert_same(engine.generate(PROMPTS, PARAMS["greedy"]), before)


def test_models_it_does_not_compute_exactly_decode_through_hf():
    moe = Qwen3MoeConfig(**SIZE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    sliding = Qwen2Config(**SIZE, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert not covers(AutoModelForCausalLM.from_config(moe)) and not covers(AutoModelForCausalLM.from_config(sliding))
    assert covers(AutoModelForCausalLM.from_config(Qwen2Config(**SIZE)))
