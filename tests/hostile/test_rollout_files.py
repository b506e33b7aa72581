"""Malformed dataset files for train-only mode (miles_core/dump.py read_rollouts), written the way a user or a broken
export would: each is refused with a short BatchError naming the file, the 1-based row (the line for JSONL) and the
column, and the file is left as it was. What the batch schema checks is tests/hostile/test_batches.py's; here, that
its refusals name the rows of the user's file."""

import json

import pandas as pd
import pytest

from miles_core.dump import read_rollouts
from miles_core.samples import Sample, to_frame
from miles_core.schemas import BatchError

VOCAB = 100


def rows():
    """Two groups of two, as a dump's JSONL holds them (with its readable columns, which reading drops)."""
    samples = [Sample(f"p{i // 2}", i % 2, [5, 6, 7], [8, 9, 2], [-0.5, -0.25, -1.0], [1, 1, 1], "stop", 3, "10", {"k": i}, 1.0) for i in range(4)]
    out = []
    for row in to_frame(samples).to_dict(orient="records"):
        out.append({**row, "routed_experts": [], "prompt": "5 6 7", "response": "8 9", "advantages": None, "trainer_logprobs": None})
    return out


def changed(at, **values):
    def build():
        out = rows()
        out[at].update(values)
        return out

    return build


def without(at, key):
    def build():
        out = rows()
        del out[at][key]
        return out

    return build


# (name, the rows, what the message must name besides the file); rows are 1-based: the JSONL line
CASES = [
    ("reward-a-word", changed(1, reward="high"), ["row 2", "column reward", "expected float", "'high'"]),
    ("reward-a-bool", changed(0, reward=True), ["row 1", "column reward"]),
    ("index-a-string", changed(3, index="1"), ["row 4", "column index", "expected int"]),
    ("label-a-number", changed(2, label=10), ["row 3", "column label", "expected str"]),
    ("weight-version-missing", without(2, "weight_version"), ["row 3", "column weight_version", "missing"]),
    ("response-tokens-missing", without(0, "response_tokens"), ["row 1", "column response_tokens", "missing"]),
    ("logprobs-short", changed(3, rollout_logprobs=[-0.5]), ["rows [4]", "columns response_tokens, rollout_logprobs, loss_mask", "aligned_lengths", "p1/1"]),
    ("token-over-vocabulary", changed(1, response_tokens=[8, VOCAB, 2]), ["rows [2]", "column response_tokens", f"ids_below_vocab_size({VOCAB})"]),
    ("reward-out-of-range", changed(2, reward=5.0), ["row 3", "column reward", "outside [0.0, 1.0]"]),
    ("mask-not-binary", changed(0, loss_mask=[1, 3, 1]), ["rows [1]", "column loss_mask", "binary_mask"]),
    ("unknown-column", changed(0, advantage_typo=1.0), ["unexpected columns", "advantage_typo"]),
    ("half-a-group", lambda: rows()[:3], ["rows [3]", "whole_groups_of(2)"]),
]


MIXED_TYPES = {"reward-a-word", "reward-a-bool", "index-a-string", "label-a-number"}  # JSONL only


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("name,build,needles", CASES, ids=[c[0] for c in CASES])
def test_malformed_dataset_is_refused_naming_file_row_and_column(tmp_path, fmt, name, build, needles):
    path = tmp_path / f"{name}.{fmt}"
    data = build()
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in data))
    else:
        if name in MIXED_TYPES:
            pytest.skip("a parquet column holds one type")
        pd.DataFrame(data).to_parquet(path, index=False)
    before = path.read_bytes()
    with pytest.raises(BatchError) as err:
        read_rollouts(path, reward_range=(0.0, 1.0), vocab_size=VOCAB, group_size=2)
    message = str(err.value)
    assert len(message) < 600 and str(path) in message, message
    for needle in needles:
        assert needle in message, message
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "content,needles",
    [
        (lambda: "".join(json.dumps(r) + "\n" for r in rows()[:2]) + "{not json\n", ["row 3", "not JSON"]),
        (lambda: json.dumps(rows()[0]) + "\n\n[1, 2]\n", ["row 3", "expected an object of columns, got list"]),
        (lambda: "\n\n", ["no rows"]),
    ],
    ids=["line-not-json", "line-a-list", "empty"],
)
def test_unreadable_lines_are_refused_at_their_line(tmp_path, content, needles):
    path = tmp_path / "rollouts.jsonl"
    path.write_text(content())
    with pytest.raises(BatchError) as err:
        read_rollouts(path, group_size=2)
    assert str(path) in str(err.value) and all(n in str(err.value) for n in needles), str(err.value)


def test_a_minimal_user_file_reads_with_metadata_as_an_object_and_no_routing(tmp_path):
    path = tmp_path / "mine.jsonl"
    keep = ("prompt_id", "index", "prompt_tokens", "response_tokens", "rollout_logprobs", "loss_mask", "finish_reason", "weight_version", "label", "reward")
    path.write_text("".join(json.dumps({k: row[k] for k in keep} | {"metadata": {"k": i}}) + "\n" for i, row in enumerate(rows())))
    samples = read_rollouts(path, reward_range=(0.0, 1.0), vocab_size=VOCAB, group_size=2)
    assert [s.sample_id for s in samples] == ["p0/0", "p0/1", "p1/0", "p1/1"] and samples[3].metadata == {"k": 3} and samples[0].routed_experts == []
