"""The distillation teacher (miles_core/distill.py): admitted only with the policy's tokenizer, its log-probs of a batch
stored per sample and checked by the batch schema (miles_core/schemas.py) wherever the batch crosses a task boundary."""

from __future__ import annotations

import math

import pytest

from miles_core.batch_io import read_batch, write_batch
from miles_core.config import DistillConfig, ModelConfig
from miles_core.distill import admit_teacher, load_teacher, score_with_teacher
from miles_core.models.tiny import build_tiny_model
from miles_core.samples import Sample
from miles_core.schemas import BatchError
from miles_core.train.base import pack
from miles_core.weights.check import CheckpointError

STUDENT = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
TEACHER = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    return {name: build_tiny_model(cfg, str(root / name)) for name, cfg in (("student", STUDENT), ("teacher", TEACHER))}


def batch() -> list[Sample]:
    """Two samples of one prompt, the second's middle token a tool's output (out of the loss)."""
    common = {"prompt_id": "p0", "prompt_tokens": [5, 6, 7], "finish_reason": "stop", "weight_version": 0, "label": "1", "reward": 1.0}
    return [
        Sample(index=0, response_tokens=[20, 21], rollout_logprobs=[-1.0, -2.0], loss_mask=[1, 1], **common),
        Sample(index=1, response_tokens=[22, 23, 24], rollout_logprobs=[-1.0, -1.5, -0.5], loss_mask=[1, 0, 1], **common),
    ]


def test_a_teacher_with_the_policys_tokenizer_is_admitted(models):
    admit_teacher(models["teacher"], models["student"], "s3://models/teacher", "s3://runs/sft/0000")


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(models, tmp_path):
    other = build_tiny_model(
        ModelConfig(arch="glm4_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128), str(tmp_path / "glm")
    )
    with pytest.raises(CheckpointError) as err:
        admit_teacher(other, models["student"], "s3://models/glm-teacher", "s3://runs/sft/0000")
    message = str(err.value)
    assert message.startswith("distill.teacher: the teacher's tokenizer (s3://models/glm-teacher, ")
    assert "differs from the policy's (s3://runs/sft/0000, " in message and "distil from a teacher with the policy's tokenizer" in message


def test_the_teachers_log_probs_are_its_trainers_and_travel_with_the_batch(models, tmp_path):
    teacher, samples = load_teacher(DistillConfig(teacher="t", micro_batch_size=1), models["teacher"]), batch()
    expected = teacher.logprobs(pack(samples, 0), 0.7)  # [2, 3]: the log-probs the trainer would compute
    assert set(score_with_teacher(teacher, samples, 0, 0.7)) == {"time/teacher_s"}
    assert [len(s.teacher_logprobs) for s in samples] == [2, 3]
    for row, s in zip(expected, samples):
        assert s.teacher_logprobs == pytest.approx(row[: len(s.response_tokens)].tolist())
    path = write_batch(samples, tmp_path / "distilled.parquet", distilled=True, group_size=2)
    assert [s.teacher_logprobs for s in read_batch(path, distilled=True)] == [s.teacher_logprobs for s in samples]
    packed = pack(read_batch(path, distilled=True), 0)
    assert packed.teacher_logprobs.tolist()[1] == pytest.approx(samples[1].teacher_logprobs)


def test_a_batch_the_teacher_did_not_score_or_scored_wrongly_is_refused(tmp_path):
    with pytest.raises(BatchError, match="column teacher_logprobs: check 'teacher_scored' failed at rows \\[0, 1\\]"):
        write_batch(batch(), tmp_path / "b.parquet", distilled=True)
    short, nan = batch(), batch()
    short[1].teacher_logprobs = [-1.0, -2.0]  # one token short
    with pytest.raises(BatchError, match="columns response_tokens, teacher_logprobs: check 'teacher_logprobs_aligned' failed at rows \\[1\\]"):
        write_batch(short, tmp_path / "b.parquet", scored=True)
    nan[0].teacher_logprobs = [-1.0, math.nan]
    with pytest.raises(BatchError, match="column teacher_logprobs: check 'finite_logprobs' failed at rows \\[0\\]"):
        write_batch(nan, tmp_path / "b.parquet", scored=True)
    assert not (tmp_path / "b.parquet").exists()
