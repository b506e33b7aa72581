"""BF16 end to end on CPU: the embedded engine rolls out in bf16 (rollout.dtype) and each backend trains in bf16
(train.dtype) for a few RL steps of tests/bf16_runs.py. Every step's train/rollout mismatch metrics are finite, the
policy improves, the optimizer steps fp32 master weights with fp32 Adam moments, and the weights publish in bf16.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from miles_core.config import TrainConfig
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.engines import make_engine
from miles_core.step import generate, sampling_params
from miles_core.train.base import pack
from miles_core.train.torch_backend import TorchTrainer
from tests import bf16_runs
from tests.megatron_runs import run_worker

TRAIN = TrainConfig(dtype="bfloat16", lr=1e-2)


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    return build_tiny_model(bf16_runs.MODEL, str(tmp_path_factory.mktemp("bf16") / "policy"))


def test_torch_backend_trains_in_bf16_on_fp32_master_weights(policy, tmp_path):
    torch.manual_seed(0)
    trainer = TorchTrainer.from_hf(policy, TRAIN)
    result = bf16_runs.report(trainer, [trainer.optimizer], policy, tmp_path / "published")
    bf16_runs.check_report(result)
    assert bf16_runs.dtypes(trainer.model.parameters()) == ["float32"]


def test_torch_bf16_computes_in_bf16(policy):
    """The same fp32 weights give other log-probs under bf16 compute, within bf16's rounding."""
    tokenizer = AutoTokenizer.from_pretrained(policy)
    rollout = bf16_runs.ROLLOUT
    samples, _ = generate(make_engine(rollout, policy, 0), bf16_runs.PROMPTS, tokenizer, sampling_params(rollout, tokenizer, seed=0))
    batch = pack(samples, tokenizer.pad_token_id)
    fp32, bf16 = (TorchTrainer.from_hf(policy, TrainConfig(dtype=dtype)).logprobs(batch, 1.0) for dtype in ("float32", "bfloat16"))
    gap = ((fp32 - bf16) * batch.response_mask).abs().max().item()
    assert 1e-4 < gap < 0.1, gap


@pytest.mark.integration
def test_megatron_backend_trains_in_bf16_on_fp32_main_params(tmp_path):
    result = run_worker("bf16", tmp_path, tmp_path)
    bf16_runs.check_report(result)
    assert result["matrices"] == ["bfloat16"]  # the model's weight matrices are bf16; the optimizer steps their fp32 main copies
