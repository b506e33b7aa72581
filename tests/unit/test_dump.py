"""The readable dump of a batch (miles_core/dump.py) after a real train step of the tiny model: its text is the
tokenizer's decoding, its rewards and rollout log-probs the batch's, its advantages and trainer log-probs the step's,
one value per response token; written as parquet and JSONL, either reads back as the same batch."""

import json

import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from miles_core.config import ModelConfig, RolloutConfig, TrainConfig
from miles_core.dump import JSONL, PARQUET, read_rollouts, readable_frame, write_dump
from miles_core.models.tiny import build_tiny_model
from miles_core.samples import Sample
from miles_core.step import bind, train_step
from miles_core.train.base import pack
from miles_core.train.torch_backend import TorchTrainer

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
PAIRS = RolloutConfig(n_samples=2)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_model(TINY, str(tmp_path_factory.mktemp("m") / "base"))


def batch():
    """Two groups of two; responses of 3, 1, 2 and 3 tokens (the trace is padded to 3), the last ends in eos (2)."""
    responses = [[40, 41, 42], [43], [44, 45], [46, 47, 2]]
    return [
        Sample(f"p{i // 2}", i % 2, [1, 20 + i // 2, 21], r, [-1.0 - 0.1 * t for t in range(len(r))], [1] * len(r), "stop", 3, "x", {"k": i}, float(i % 2))
        for i, r in enumerate(responses)
    ]


@pytest.fixture(scope="module")
def dumped(policy_dir):
    samples, trace = batch(), {}
    trainer = TorchTrainer.from_hf(policy_dir, TrainConfig())
    before = trainer.logprobs(pack(samples, 0), 1.0)  # [B, T] the policy the step starts from
    train_step(trainer, samples, bind(rollout=PAIRS), pad_id=0, trace=trace)
    return samples, before, readable_frame(samples, AutoTokenizer.from_pretrained(policy_dir), trace)


def test_rows_are_the_batch_decoded_with_the_steps_advantages_and_trainer_logprobs(policy_dir, dumped):
    samples, before, frame = dumped
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    assert frame["sample_id"].tolist() == ["p0/0", "p0/1", "p1/0", "p1/1"]
    assert frame["prompt"].tolist() == [tokenizer.decode(s.prompt_tokens) for s in samples]
    assert frame["response"].tolist() == [tokenizer.decode(s.response_tokens, skip_special_tokens=True) for s in samples]
    assert frame["reward"].tolist() == [0.0, 1.0, 0.0, 1.0] and frame["weight_version"].tolist() == [3] * 4
    assert frame["response_length"].tolist() == [3, 1, 2, 3]
    for i, s in enumerate(samples):
        assert list(frame.at[i, "rollout_logprobs"]) == s.rollout_logprobs
        assert frame.at[i, "trainer_logprobs"] == pytest.approx(before[i, : len(s.response_tokens)].tolist(), abs=1e-6)
        advantages = frame.at[i, "advantages"]
        assert len(advantages) == len(s.response_tokens) and len(set(advantages)) == 1  # GRPO: the sample's advantage on every token
        assert advantages[0] > 0 if s.reward == 1.0 else advantages[0] < 0  # above or below its group's mean


def test_without_a_train_step_the_step_columns_are_empty(policy_dir):
    frame = readable_frame(batch(), AutoTokenizer.from_pretrained(policy_dir))
    assert frame["advantages"].isna().all() and frame["trainer_logprobs"].isna().all()
    assert frame["response"].tolist()[1] == AutoTokenizer.from_pretrained(policy_dir).decode([43])


def test_parquet_and_jsonl_hold_the_same_rows_and_read_back_as_the_batch(dumped, tmp_path):
    samples, _, frame = dumped
    out = write_dump(frame, tmp_path / "dump")
    lines = [json.loads(line) for line in (out / JSONL).read_text().splitlines()]
    table = pd.read_parquet(out / PARQUET)
    assert list(table.columns) == list(lines[0]) == list(frame.columns)
    for row, line in zip(table.to_dict(orient="records"), lines):
        assert {k: v.tolist() if hasattr(v, "tolist") else v for k, v in row.items()} == line
    for name in (JSONL, PARQUET):
        assert read_rollouts(out / name, reward_range=(0.0, 1.0), vocab_size=100, group_size=2) == samples


def test_trace_rows_are_trimmed_to_each_response():
    samples = batch()
    trace = {"advantages": torch.arange(12, dtype=torch.float).view(4, 3), "trainer_logprobs": -torch.ones(4, 3)}
    frame = readable_frame(samples, _Decoder(), trace)
    assert frame["advantages"].tolist() == [[0.0, 1.0, 2.0], [3.0], [6.0, 7.0], [9.0, 10.0, 11.0]]
    assert frame["trainer_logprobs"].tolist()[2] == [-1.0, -1.0]


class _Decoder:
    def decode(self, tokens, skip_special_tokens=False):
        return " ".join(map(str, tokens))
