"""Rollout batches: the pandera schema at task boundaries names file, rows, column and check."""

import math

import numpy as np
import pandas as pd
import pytest

from miles_core.batch_io import read_batch, write_batch
from miles_core.recent import Recent
from miles_core.samples import Sample, from_frame, to_frame
from miles_core.schemas import BatchError, check_batch


def batch(n=4, reward=float("nan")):
    return [Sample(f"p{i // 2}", i % 2, [5, 6, 7], [8, 9, 2], [-0.5, -0.25, -1.0], [1, 1, 1], "stop", 3, "12", {"k": i}, reward) for i in range(n)]


def test_round_trip_through_parquet(tmp_path):
    samples = batch(reward=1.0)
    path = write_batch(samples, tmp_path / "b.parquet", scored=True, reward_range=(0, 1))
    back = read_batch(path, scored=True, reward_range=(0, 1))
    assert [s.sample_id for s in back] == ["p0/0", "p0/1", "p1/0", "p1/1"]
    assert back[2].metadata == {"k": 2} and back[2].rollout_logprobs == [-0.5, -0.25, -1.0] and back[0].reward == 1.0


def test_samples_come_back_as_python_values_from_any_column_types(tmp_path):
    """Whatever a checked frame holds (parquet's arrays of any width, a JSON file's lists), each sample's values are of
    its fields' Python types, equal to what was written."""
    samples = batch(reward=1.0)
    samples[0].routed_experts, samples[0].teacher_logprobs = [3, 1, 0, 2, 1, 3, 0, 1, 2, 3], [-0.5, -0.75, -2.0]  # 5 positions fed x 2
    frame = to_frame(samples)
    arrays = frame.assign(
        prompt_tokens=[np.asarray(t, dtype=np.int32) for t in frame["prompt_tokens"]],
        rollout_logprobs=[np.asarray(t, dtype=np.float32) for t in frame["rollout_logprobs"]],
        loss_mask=[np.asarray(t, dtype=np.uint8) for t in frame["loss_mask"]],
    )
    lists = frame.assign(rollout_logprobs=[[-1, -0.25, -1] for _ in range(len(frame))], routed_experts=[list(e) for e in frame["routed_experts"]])
    for back in (from_frame(arrays), from_frame(lists), read_batch(write_batch(samples, tmp_path / "b.parquet"))):
        assert [s.prompt_tokens for s in back] == [s.prompt_tokens for s in samples]
        assert all(type(v) is int for s in back for v in (*s.prompt_tokens, *s.response_tokens, *s.loss_mask, *s.routed_experts, s.index))
        assert all(type(v) is float for s in back for v in (*s.rollout_logprobs, *s.teacher_logprobs, s.reward))
        assert all(type(v) is str for s in back for v in (s.prompt_id, s.finish_reason, s.label)) and back[3].metadata == {"k": 3}
    assert from_frame(lists)[0].rollout_logprobs == [-1.0, -0.25, -1.0] and from_frame(arrays)[0].routed_experts == [3, 1, 0, 2, 1, 3, 0, 1, 2, 3]


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


def test_float_negative_and_out_of_vocabulary_token_ids():
    floats, negative, large = batch(), batch(), batch()
    floats[1].prompt_tokens = [5.0, 6.5]
    negative[2].response_tokens = [8, -1, 2]
    large[3].prompt_tokens = [5, 32000]
    expect(to_frame(floats), "column prompt_tokens", "integer_ids", "rows [1]", "p0/1")
    expect(to_frame(negative), "column response_tokens", "non_negative_ids", "rows [2]", "p1/0")
    expect(to_frame(large), "column prompt_tokens", "ids_below_vocab_size(32000)", "rows [3]", "p1/1", vocab_size=32000)
    check_batch(to_frame(large), "b.parquet", vocab_size=32001)  # 32000 is the last id of a 32001-token vocabulary
    check_batch(to_frame(large), "b.parquet")  # without a vocabulary size only the sign is checked


MALFORMED = [
    ("prompt_tokens", [True, 6], "integer_ids"),
    ("prompt_tokens", [5, 2**64], "integer_ids"),
    ("prompt_tokens", ["5", 6], "integer_ids"),
    ("response_tokens", [8, None], "integer_ids"),
    ("response_tokens", [[8], [9]], "integer_ids"),
    ("response_tokens", "892", "integer_ids"),
    ("response_tokens", [8, -3, 2], "non_negative_ids"),
    ("rollout_logprobs", [-0.5, float("inf"), -1.0], "finite_logprobs"),
    ("rollout_logprobs", [-0.5, 0.5, -1.0], "finite_logprobs"),
    ("rollout_logprobs", [-0.5, "x", -1.0], "finite_logprobs"),
    ("loss_mask", [1, 1.0, 1], "binary_mask"),
    ("loss_mask", [1, 2, 1], "binary_mask"),
    ("loss_mask", [1, "1", 1], "binary_mask"),
    ("routed_experts", [0, -1], "expert_ids"),
    ("routed_experts", [0.5, 1], "expert_ids"),
]


@pytest.mark.parametrize("column, value, check", MALFORMED)
def test_a_malformed_value_names_its_row_among_well_formed_rows(column, value, check):
    """The checks read a whole column at once where every row is well formed; one bad row among many is still named."""
    frame = to_frame(batch(64))
    frame.at[37, column] = value
    expect(frame, f"column {column}", check, "rows [37]", "p18/1")


@pytest.mark.parametrize("column", ["label", "metadata", "finish_reason"])
def test_a_text_column_holding_another_type_names_the_row(column):
    """A frame's text column is of pandas' string dtype and passes as one; one a user's file filled with other values
    (an object column) is checked row by row, and the row that is not text is named."""
    frame = to_frame(batch(64))
    assert isinstance(frame[column].dtype, pd.StringDtype)
    frame[column] = frame[column].astype(object)
    frame.at[37, column] = 12
    expect(frame, f"column {column}", "rows [37]", "p18/1")


@pytest.mark.parametrize("column", ["prompt_tokens", "response_tokens", "rollout_logprobs", "loss_mask", "metadata"])
def test_a_missing_value_names_its_row(column):
    frame = to_frame(batch(64))
    frame.at[21, column] = None
    expect(frame, f"column {column}", "rows [21]", "p10/1")


def test_numpy_rows_as_parquet_reads_them_are_checked_like_lists(tmp_path):
    samples = batch(64)
    samples[21].response_tokens = [8, 9, 70000]
    path = write_batch(samples, tmp_path / "b.parquet")
    with pytest.raises(BatchError, match=r"ids_below_vocab_size\(65536\)' failed at rows \[21\]"):
        read_batch(path, vocab_size=65536, group_size=2)
    frame = pd.read_parquet(path)
    frame.at[5, "loss_mask"] = frame.at[5, "loss_mask"] * 2  # an int64 array of twos
    frame.at[9, "prompt_tokens"] = frame.at[9, "prompt_tokens"].astype(float)
    expect(frame, "binary_mask", "rows [5]", "integer_ids", "rows [9]")
    assert [s.response_tokens for s in read_batch(path)][21] == [8, 9, 70000]


def test_sample_id_must_be_prompt_id_slash_index():
    frame = to_frame(batch())
    frame.at[1, "sample_id"] = "p7/1"
    expect(frame, "columns sample_id, prompt_id, index", "sample_id_matches_group", "rows [1]")


def test_one_label_per_group():
    samples = batch()
    samples[3].label = "13"  # p1's group: rows 2 (label 12) and 3 (label 13)
    expect(to_frame(samples), "columns prompt_id, label", "one_label_per_group", "rows [2, 3]", "p1/0")


def test_whole_groups_of_the_group_size():
    expect(to_frame(batch(3)), "whole_groups_of(2)", "rows [2]", "p1/0", group_size=2)  # p1's second sample is in another batch
    shuffled = batch()
    shuffled[1], shuffled[2] = shuffled[2], shuffled[1]  # p0/0, p1/0, p0/1, p1/1: both groups interleaved
    expect(to_frame(shuffled), "whole_groups_of(2)", "rows [0, 1, 2, 3]", group_size=2)
    expect(to_frame(batch()), "whole_groups_of(4)", group_size=4)  # two groups of 2 are not one group of 4
    check_batch(to_frame(batch()), "b.parquet", group_size=2)


def test_read_checks_vocabulary_and_groups_and_leaves_a_refused_file_as_it_was(tmp_path):
    path = write_batch(batch(3), tmp_path / "b.parquet")
    before = path.read_bytes()
    with pytest.raises(BatchError, match="whole_groups_of"):
        read_batch(path, group_size=2)
    with pytest.raises(BatchError, match=r"ids_below_vocab_size\(9\)"):
        read_batch(path, vocab_size=9)
    assert path.read_bytes() == before and len(read_batch(path)) == 3


def test_a_batch_is_checked_once_per_content_and_checks_in_a_process(tmp_path, monkeypatch):
    """Reading back the bytes this process wrote and checked with the same checks skips checking them again;
    other bytes at the same path, other checks, or a process that did not write them check the batch."""
    from miles_core import batch_io

    calls = []
    monkeypatch.setattr(batch_io, "check_batch", lambda frame, source, *checks: calls.append((source, checks)) or frame)
    monkeypatch.setattr(batch_io, "_checked", Recent(2))
    path = write_batch(batch(4, reward=1.0), tmp_path / "b.parquet", scored=True)
    assert len(read_batch(path, scored=True)) == 4 and len(calls) == 1  # the write's check only
    read_batch(path, scored=True, group_size=2)
    assert len(calls) == 2  # other checks
    frame = to_frame(batch(4, reward=1.0))
    frame.loc[1, "response_tokens"] = [8, -9, 2]
    frame.to_parquet(path, index=False)  # the same path, bytes nobody checked
    read_batch(path, scored=True)
    assert len(calls) == 3
    for i in range(3):  # the oldest contents are forgotten first
        write_batch(batch(4, reward=float(i)), tmp_path / f"{i}.parquet", scored=True)
    read_batch(tmp_path / "0.parquet", scored=True)
    assert len(calls) == 7
    monkeypatch.undo()
    with pytest.raises(BatchError, match="non_negative_ids"):
        read_batch(path, scored=True)


def test_unreadable_file_names_the_file(tmp_path):
    path = tmp_path / "junk.parquet"
    path.write_bytes(b"not parquet")
    with pytest.raises(BatchError, match="junk.parquet: not a readable parquet file"):
        read_batch(path)
    assert path.read_bytes() == b"not parquet"
