"""Prompt files (jsonl/parquet) with row-level errors, and the resumable PromptSource."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_core.data.source import DataError, DataState, Prompt, PromptSource, load_prompts


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_load_jsonl(tmp_path):
    path = write_lines(
        tmp_path / "prompts.jsonl",
        [
            json.dumps({"input": "1+2=", "label": "3", "metadata": {"id": "a", "carries": 0}}),
            "",
            json.dumps({"input": "2+2=", "label": 4}),
            json.dumps({"input": "x", "label": 2.0, "metadata": None}),
            json.dumps({"input": "y", "label": 2.5}),
        ],
    )
    prompts = load_prompts(path)
    assert prompts[0] == Prompt(id="a", text="1+2=", label="3", metadata={"id": "a", "carries": 0})
    assert prompts[1] == Prompt(id="prompts-3", text="2+2=", label="4", metadata={})
    assert [p.label for p in prompts[2:]] == ["2", "2.5"]


def test_load_parquet_with_custom_keys(tmp_path):
    path = tmp_path / "p.parquet"
    table = pa.table({"q": ["1+1=", "3+4="], "a": ["2", "7"], "m": [{"id": "x"}, {"id": "y"}]})
    pq.write_table(table, path)
    prompts = load_prompts(path, input_key="q", label_key="a", metadata_key="m")
    assert [(p.id, p.text, p.label) for p in prompts] == [("x", "1+1=", "2"), ("y", "3+4=", "7")]


BAD_ROWS = [
    ('{"input": "1+1=", "label": "2"', None, "invalid JSON"),
    ('{"label": "2"}', "input", "missing input key"),
    ('{"input": "1+1="}', "label", "missing label key"),
    ('{"input": "", "label": "2"}', "input", "non-empty string"),
    ('{"input": "   \\n", "label": "2"}', "input", "non-empty string"),
    ('{"input": 5, "label": "2"}', "input", "non-empty string"),
    ('{"input": "1+1=", "label": null}', "label", "missing (null)"),
    ('{"input": "1+1=", "label": [2]}', "label", "string or a number"),
    ('{"input": "1+1=", "label": true}', "label", "string or a number"),
    ('{"input": "1+1=", "label": "2", "metadata": [1]}', "metadata", "must be a dict"),
    ('{"input": "1+1=", "label": "2", "metadata": {"id": "first"}}', "metadata.id", "duplicate id"),
    ("[1, 2]", None, "JSON object"),
]


@pytest.mark.parametrize("bad,key,reason", BAD_ROWS)
def test_bad_row_names_file_row_key_and_reason(tmp_path, bad, key, reason):
    good = '{"input": "0+0=", "label": "0", "metadata": {"id": "first"}}'
    path = write_lines(tmp_path / "bad.jsonl", [good, bad])
    with pytest.raises(DataError) as err:
        load_prompts(path)
    message = str(err.value)
    assert str(path) in message and "row 2" in message and reason in message
    if key is not None:
        assert repr(key) in message


def test_empty_file_and_unknown_extension(tmp_path):
    for path in (write_lines(tmp_path / "empty.jsonl", []), write_lines(tmp_path / "blank.jsonl", ["", "  "])):
        with pytest.raises(DataError, match="no rows"):
            load_prompts(path)
    odd = write_lines(tmp_path / "prompts.csv", ["input,label"])
    with pytest.raises(DataError, match="prompts.csv"):
        load_prompts(odd)
    with pytest.raises(DataError, match="not found"):
        load_prompts(tmp_path / "missing.jsonl")


def test_bad_parquet_row(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"input": ["1+1=", " "], "label": ["2", "0"]}), path)
    with pytest.raises(DataError, match=r"p\.parquet: row 2: key 'input'"):
        load_prompts(path)


def make_prompts(n):
    return [Prompt(id=f"p{i}", text=f"{i}+0=", label=str(i), metadata={}) for i in range(n)]


def test_each_epoch_is_a_permutation_and_batches_cross_epochs():
    prompts = make_prompts(7)
    source = PromptSource(prompts, seed=3)
    stream = [p.id for _ in range(7) for p in source.next_batch(3)]  # 21 prompts = 3 epochs
    assert source.state == DataState(epoch=3, offset=0)
    epochs = [stream[i : i + 7] for i in range(0, 21, 7)]
    assert all(sorted(e) == sorted(p.id for p in prompts) for e in epochs)
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    assert [p.id for p in PromptSource(prompts, seed=3).next_batch(7)] == epochs[0]
    assert [p.id for p in PromptSource(prompts, seed=4).next_batch(7)] != epochs[0]


def test_batch_larger_than_dataset():
    source = PromptSource(make_prompts(3), seed=0)
    assert len(source.next_batch(8)) == 8 and source.state == DataState(epoch=2, offset=2)


@pytest.mark.parametrize("stop_after", [0, 1, 2, 5])
def test_resume_from_state_equals_continuing(stop_after):
    prompts = make_prompts(10)
    original = PromptSource(prompts, seed=11)
    for _ in range(stop_after):
        original.next_batch(4)
    resumed = PromptSource(prompts, seed=11, state=original.state)
    for _ in range(6):
        assert original.next_batch(4) == resumed.next_batch(4)
    assert original.state == resumed.state


def test_invalid_source_arguments():
    with pytest.raises(ValueError):
        PromptSource([], seed=0)
    with pytest.raises(ValueError):
        PromptSource(make_prompts(3), seed=0, state=DataState(epoch=0, offset=3))
    with pytest.raises(ValueError):
        PromptSource(make_prompts(3), seed=0).next_batch(0)
