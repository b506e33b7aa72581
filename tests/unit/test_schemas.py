"""Rollout batches: the pandera schema at task boundaries names file, rows, column and check."""

import math

import pandas as pd
import pytest

from miles_core.samples import Sample, from_frame, to_frame
from miles_core.schemas import BatchError, check_batch, read_batch, write_batch


def batch(n=4, reward=float("nan")):
    return [Sample(f"p{i // 2}", i % 2, [5, 6, 7], [8, 9, 2], [-0.5, -0.25, -1.0], [1, 1, 1], "stop", 3, "12", {"k": i}, reward) for i in range(n)]


def test_round_trip_through_parquet(tmp_path):
    samples = batch(reward=1.0)
    path = write_batch(samples, tmp_path / "b.parquet", scored=True, reward_range=(0, 1))
    back = read_batch(path, scored=True, reward_range=(0, 1))
    assert [s.sample_id for s in back] == ["p0/0", "p0/1", "p1/0", "p1/1"]
    assert back[2].metadata == {"k": 2} and back[2].rollout_logprobs == [-0.5, -0.25, -1.0] and back[0].reward == 1.0


def expect(frame, *needles, **kwargs):
    with pytest.raises(BatchError) as err:
        check_batch(frame, "runs/rollout/0001.parquet", **kwargs)
    message = str(err.value)
    assert "runs/rollout/0001.parquet" in message
    for needle in needles:
        assert needle in message, message


def test_mask_token_length_mismatch_names_the_row():
    samples = batch()
    samples[2].loss_mask = [1, 1]
    expect(to_frame(samples), "aligned_lengths", "rows [2]", "p1/0")


def test_nan_logprob_names_the_column_and_row():
    samples = batch()
    samples[1].rollout_logprobs = [-0.1, math.nan, -0.2]
    expect(to_frame(samples), "column rollout_logprobs", "finite_logprobs", "rows [1]", "p0/1")


def test_reward_out_of_range_names_the_row_and_value():
    samples = batch(reward=0.0)
    samples[3].reward = 7.0
    expect(to_frame(samples), "row 3", "p1/1", "7.0 outside [0, 1]", scored=True, reward_range=(0, 1))


def test_missing_reward_in_a_scored_batch():
    expect(to_frame(batch()), "reward", scored=True)


def test_unknown_finish_reason_and_duplicate_ids():
    samples = batch()
    samples[0].finish_reason = "exploded"
    samples[1].index = 0
    expect(to_frame(samples), "finish_reason", "sample_id")


def test_unexpected_column():
    frame = to_frame(batch())
    frame["extra"] = 1
    expect(frame, "extra")


def test_a_failed_write_leaves_the_previous_file(tmp_path):
    path = write_batch(batch(), tmp_path / "b.parquet")
    before = path.read_bytes()
    bad = batch()
    bad[0].response_tokens = []
    with pytest.raises(BatchError):
        write_batch(bad, path)
    assert path.read_bytes() == before
    assert len(from_frame(pd.read_parquet(path))) == 4
