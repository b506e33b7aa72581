"""The addition problem set: the imperfect teacher, split sizes and disjointness, jsonl output."""

import dataclasses
import json
import random

import pytest

from miles_core.config import DataConfig
from miles_core.data.problems import count_carries, make_addition, teacher_answer, write_jsonl

SMALL = DataConfig(train_size=300, test_size=50)


@pytest.mark.parametrize(
    "a,b,error,expected",
    [
        (47, 85, 0.0, "132"),
        (47, 85, 1.0, "122"),  # the units carry is dropped; the top carry still writes the 1
        (15, 23, 0.0, "38"),
        (15, 23, 1.0, "38"),
        (99, 1, 1.0, "90"),
        (999, 1, 0.0, "1000"),
        (159, 141, 1.0, "290"),  # units carry dropped, so the tens produce no carry at all
        (5, 7, 1.0, "12"),
    ],
)
def test_teacher_answer_by_hand(a, b, error, expected):
    assert teacher_answer(a, b, error, random.Random(0)) == expected


def test_teacher_without_carries_is_always_right():
    rng = random.Random(1)
    assert {teacher_answer(15, 23, 0.5, rng) for _ in range(50)} == {"38"}
    assert {teacher_answer(47, 85, 0.5, rng) for _ in range(200)} == {"122", "132"}


def test_teacher_rejects_negative_operands():
    with pytest.raises(ValueError):
        teacher_answer(-1, 2, 0.0, random.Random(0))


def test_count_carries():
    assert count_carries(47, 85) == 1
    assert count_carries(15, 23) == 0
    assert count_carries(159, 141) == 2
    assert count_carries(999, 1) == 2


def test_rows_shape_and_labels():
    train, test = make_addition(SMALL)
    assert len(train) == 300 and len(test) == 50
    for row in train + test:
        meta = row["metadata"]
        a, b = meta["a"], meta["b"]
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert row["input"] == f"{a}+{b}=" and row["label"] == str(a + b)
        assert meta["id"] == f"add-{a}-{b}" and meta["problem_set"] == "addition"
        assert meta["carries"] == count_carries(a, b)
        if meta["carries"] == 0:
            assert set(meta["demonstrations"]) == {row["label"]}


def test_splits_are_distinct_disjoint_and_deterministic():
    train, test = make_addition(SMALL)
    train_ids = {r["metadata"]["id"] for r in train}
    test_ids = {r["metadata"]["id"] for r in test}
    assert len(train_ids) == 300 and len(test_ids) == 50 and not train_ids & test_ids
    assert make_addition(SMALL) == (train, test)
    assert make_addition(dataclasses.replace(SMALL, seed=1)) != (train, test)
    # the test split does not move when the train split grows
    assert make_addition(dataclasses.replace(SMALL, train_size=600))[1] == test


def test_teacher_makes_mistakes_only_on_carries():
    train, _ = make_addition(DataConfig(train_size=2000, test_size=10, teacher_carry_error=0.5))
    wrong = [r for r in train if r["metadata"]["demonstrations"][0] != r["label"]]
    assert wrong and all(r["metadata"]["carries"] > 0 for r in wrong)
    perfect, _ = make_addition(DataConfig(train_size=500, test_size=10, teacher_carry_error=0.0))
    assert all(set(r["metadata"]["demonstrations"]) == {r["label"]} for r in perfect)


def test_one_digit_space_can_be_exhausted_exactly():
    train, test = make_addition(DataConfig(digits=1, train_size=71, test_size=10))
    assert len({r["input"] for r in train + test}) == 81
    with pytest.raises(ValueError, match="data.train_size"):
        make_addition(DataConfig(digits=1, train_size=72, test_size=10))


def test_custom_keys():
    cfg = DataConfig(train_size=5, test_size=5, input_key="prompt", label_key="answer", metadata_key="extra")
    train, _ = make_addition(cfg)
    assert set(train[0]) == {"prompt", "answer", "extra"}


def test_write_jsonl_atomic(tmp_path):
    train, _ = make_addition(DataConfig(train_size=20, test_size=5))
    path = tmp_path / "sub" / "train.jsonl"
    write_jsonl(train, path)
    assert [json.loads(line) for line in path.read_text().splitlines()] == train
    assert [p.name for p in path.parent.iterdir()] == ["train.jsonl"]
