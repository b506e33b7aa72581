"""Malformed rollout batches, generated here and written as parquet files the way a buggy or hostile
producer would (bypassing write_batch): read_batch refuses each with a short BatchError naming the
file, the check, the column and the rows' sample ids, and leaves the file exactly as it was."""

import math

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from miles_core.batch_io import read_batch, write_batch
from miles_core.samples import Sample, to_frame
from miles_core.schemas import BatchError

VOCAB = 100


def samples(n=4, reward=1.0):
    """Groups of 2: rows 0-1 are p0/0, p0/1 and rows 2-3 are p1/0, p1/1."""
    return [Sample(f"p{i // 2}", i % 2, [5, 6, 7], [8, 9, 2], [-0.5, -0.25, -1.0], [1, 1, 1], "stop", 3, str(10 + i // 2), {"k": i}, reward) for i in range(n)]


def cell(row, column, value):
    def mutate(frame):
        frame.at[row, column] = value
        return frame

    return mutate


def column(name, values):
    def mutate(frame):
        frame[name] = values
        return frame

    return mutate


def rows(n, **changes):
    """A batch of n samples with attributes of some samples changed: changes = {attr: {row: value}}."""

    def build(_frame):
        batch = samples(n)
        for attr, by_row in changes.items():
            for row, value in by_row.items():
                setattr(batch[row], attr, value)
        return to_frame(batch)

    return build


def drop(name):
    return lambda frame: frame.drop(columns=[name])


def swap(a, b):
    return lambda frame: frame.iloc[[b if i == a else a if i == b else i for i in range(len(frame))]].reset_index(drop=True)


# (name, mutation of the frame of samples(4), read_batch arguments, what the message must name)
CASES = [
    ("prompt-float-ids", cell(1, "prompt_tokens", [5.0, 6.5]), {}, ["column prompt_tokens", "integer_ids"]),
    ("response-float-ids", column("response_tokens", [[8.0, 9.0, 2.0]] * 4), {}, ["column response_tokens", "integer_ids", "p0/0"]),
    ("prompt-string-ids", column("prompt_tokens", [["5", "6"]] * 4), {}, ["column prompt_tokens", "integer_ids", "p1/1"]),
    ("response-bool-ids", column("response_tokens", [[True, False, True]] * 4), {}, ["column response_tokens", "integer_ids"]),
    ("prompt-negative-id", cell(2, "prompt_tokens", [5, -1, 7]), {}, ["column prompt_tokens", "non_negative_ids", "rows [2]", "p1/0"]),
    ("response-negative-id", cell(3, "response_tokens", [-8, 9, 2]), {}, ["column response_tokens", "non_negative_ids", "rows [3]", "p1/1"]),
    (
        "prompt-id-at-vocab-size",
        cell(0, "prompt_tokens", [5, VOCAB]),
        {"vocab_size": VOCAB},
        ["column prompt_tokens", f"ids_below_vocab_size({VOCAB})", "rows [0]", "p0/0"],
    ),
    (
        "response-id-over-vocab",
        cell(1, "response_tokens", [8, 9, 151_000]),
        {"vocab_size": VOCAB},
        ["column response_tokens", "ids_below_vocab_size", "rows [1]", "p0/1"],
    ),
    ("response-id-2-pow-40", cell(2, "response_tokens", [2**40, 9, 2]), {"vocab_size": VOCAB}, ["column response_tokens", "ids_below_vocab_size", "p1/0"]),
    ("prompt-tokens-empty", cell(0, "prompt_tokens", []), {}, ["column prompt_tokens", "non_empty", "p0/0"]),
    ("response-empty", rows(4, response_tokens={1: []}, rollout_logprobs={1: []}, loss_mask={1: []}), {}, ["column response_tokens", "non_empty", "p0/1"]),
    ("prompt-tokens-null", cell(3, "prompt_tokens", None), {}, ["column prompt_tokens", "not_nullable", "p1/1"]),
    ("mask-shorter", rows(4, loss_mask={2: [1, 1]}), {}, ["columns response_tokens, rollout_logprobs, loss_mask", "aligned_lengths", "rows [2]", "p1/0"]),
    ("logprobs-longer", rows(4, rollout_logprobs={0: [-0.1, -0.2, -0.3, -0.4]}), {}, ["aligned_lengths", "rows [0]", "p0/0"]),
    ("response-longer", rows(4, response_tokens={3: [8, 9, 2, 4]}), {}, ["aligned_lengths", "rows [3]", "p1/1"]),
    ("logprob-nan", rows(4, rollout_logprobs={1: [-0.1, math.nan, -0.2]}), {}, ["column rollout_logprobs", "finite_logprobs", "rows [1]", "p0/1"]),
    ("logprob-plus-inf", rows(4, rollout_logprobs={2: [math.inf, -0.1, -0.2]}), {}, ["column rollout_logprobs", "finite_logprobs", "p1/0"]),
    ("logprob-minus-inf", rows(4, rollout_logprobs={3: [-math.inf, -0.1, -0.2]}), {}, ["column rollout_logprobs", "finite_logprobs", "p1/1"]),
    ("logprob-positive", rows(4, rollout_logprobs={0: [0.5, -0.1, -0.2]}), {}, ["column rollout_logprobs", "finite_logprobs", "p0/0"]),
    ("mask-two", rows(4, loss_mask={1: [1, 2, 1]}), {}, ["column loss_mask", "binary_mask", "p0/1"]),
    ("mask-minus-one", rows(4, loss_mask={2: [1, -1, 1]}), {}, ["column loss_mask", "binary_mask", "p1/0"]),
    ("mask-fractional", column("loss_mask", [[1.0, 0.5, 1.0]] * 4), {}, ["column loss_mask", "binary_mask"]),
    ("sample-id-of-another-group", cell(1, "sample_id", "p1/1"), {}, ["sample_id_matches_group"]),
    ("sample-id-wrong-index", cell(2, "sample_id", "p1/7"), {}, ["columns sample_id, prompt_id, index", "sample_id_matches_group", "rows [2]", "p1/7"]),
    ("duplicate-sample", rows(4, index={1: 0}), {}, ["column sample_id", "field_uniqueness", "p0/0"]),
    ("index-negative", rows(4, index={3: -1}), {}, ["column index", "greater_than_or_equal_to(0)", "p1/-1"]),
    ("mixed-labels", rows(4, label={3: "99"}), {}, ["columns prompt_id, label", "one_label_per_group", "rows [2, 3]", "p1/0"]),
    ("group-split-across-batches", rows(3), {"group_size": 2}, ["columns prompt_id, index", "whole_groups_of(2)", "rows [2]", "p1/0"]),
    ("groups-interleaved", swap(1, 2), {"group_size": 2}, ["whole_groups_of(2)", "rows [0, 1, 2, 3]", "p1/0"]),
    ("indices-out-of-order", swap(2, 3), {"group_size": 2}, ["whole_groups_of(2)", "rows [2, 3]", "p1/1"]),
    ("groups-smaller-than-group-size", lambda f: f, {"group_size": 4}, ["whole_groups_of(4)", "rows [0, 1, 2, 3]"]),
    ("group-without-index-0", rows(4, index={2: 2, 3: 3}), {"group_size": 2}, ["whole_groups_of(2)", "rows [2, 3]", "p1/2"]),
    ("missing-label-column", drop("label"), {}, ["missing columns", "'label'"]),
    ("missing-reward-column", drop("reward"), {}, ["missing columns", "'reward'"]),
    ("unexpected-column", column("advantage", [0.0] * 4), {}, ["unexpected columns", "column_in_schema", "advantage"]),
    ("index-float", column("index", [0.0, 1.5, 0.0, 1.0]), {}, ["column index", "int64"]),
    ("weight-version-negative", column("weight_version", [3, 3, -1, 3]), {}, ["column weight_version", "greater_than_or_equal_to(0)", "p1/0"]),
    ("finish-reason-unknown", cell(0, "finish_reason", "exploded"), {}, ["column finish_reason", "isin", "p0/0"]),
    ("metadata-not-json", cell(1, "metadata", "{'k': 1"), {}, ["column metadata", "json_object", "p0/1"]),
    ("metadata-json-list", cell(2, "metadata", "[1, 2]"), {}, ["column metadata", "json_object", "p1/0"]),
    ("label-int-column", column("label", [10, 10, 11, 11]), {}, ["column label", "str"]),
    ("prompt-id-null", cell(0, "prompt_id", None), {}, ["column prompt_id", "not_nullable"]),
    ("reward-nan-when-scored", cell(1, "reward", math.nan), {"scored": True}, ["column reward", "p0/1"]),
    ("reward-infinite", cell(2, "reward", math.inf), {"scored": True}, ["column reward", "finite_reward", "p1/0"]),
    ("reward-out-of-range", cell(3, "reward", 7.0), {"scored": True, "reward_range": (0.0, 1.0)}, ["row 3", "p1/1", "7.0 outside [0.0, 1.0]"]),
    ("reward-strings", column("reward", ["1", "1", "0", "0"]), {"scored": True}, ["column reward", "float64"]),
]


@pytest.mark.parametrize("name,mutate,kwargs,needles", CASES, ids=[c[0] for c in CASES])
def test_malformed_batch_file_is_refused_and_left_as_it_was(tmp_path, name, mutate, kwargs, needles):
    path = tmp_path / f"{name}.parquet"
    mutate(to_frame(samples())).to_parquet(path, index=False)
    before = path.read_bytes()
    with pytest.raises(BatchError) as err:
        read_batch(path, **kwargs)
    message = str(err.value)
    assert len(message) < 500 and str(path) in message, message
    for needle in needles:
        assert needle in message, message
    assert path.read_bytes() == before


def junk(path):
    path.write_bytes(b"PAR1 junk")


def truncated(path):
    write_batch(samples(), path)
    path.write_bytes(path.read_bytes()[:-30])


def unrelated_table(path):
    pd.DataFrame({"x": np.arange(3)}).to_parquet(path)


FILES = [
    ("junk", junk, "not a readable parquet file"),
    ("truncated", truncated, "not a readable parquet file"),
    ("empty", lambda path: path.write_bytes(b""), "not a readable parquet file"),
    ("csv", lambda path: path.write_text("sample_id,prompt_id\np0/0,p0\n"), "not a readable parquet file"),
    ("unrelated-table", unrelated_table, "missing columns"),
]


@pytest.mark.parametrize("name,write,reason", FILES, ids=[c[0] for c in FILES])
def test_unreadable_batch_file_is_refused_and_left_as_it_was(tmp_path, name, write, reason):
    path = tmp_path / f"{name}.parquet"
    write(path)
    before = path.read_bytes()
    with pytest.raises(BatchError) as err:
        read_batch(path)
    message = str(err.value)
    assert len(message) < 500 and str(path) in message and reason in message, message
    assert path.read_bytes() == before


def test_a_refused_write_keeps_the_batch_already_written(tmp_path):
    path = write_batch(samples(), tmp_path / "step-0001.parquet", group_size=2, vocab_size=VOCAB)
    before = path.read_bytes()
    bad = samples(3)  # a split group
    with pytest.raises(BatchError, match="whole_groups_of"):
        write_batch(bad, path, group_size=2)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["step-0001.parquet"]
    assert pq.read_table(path).num_rows == 4


def test_a_well_formed_batch_passes_every_check(tmp_path):
    path = write_batch(samples(), tmp_path / "ok.parquet", scored=True, reward_range=(0, 1), vocab_size=VOCAB, group_size=2)
    assert [s.sample_id for s in read_batch(path, scored=True, reward_range=(0, 1), vocab_size=VOCAB, group_size=2)] == ["p0/0", "p0/1", "p1/0", "p1/1"]


def test_the_corpus_is_large_enough():
    assert len(CASES) + len(FILES) >= 40
