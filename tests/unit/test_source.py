"""Prompt files (jsonl/parquet) with row-level errors, and the resumable PromptSource."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_core.data.source import (
    DataError,
    DataState,
    Prompt,
    PromptSource,
    load_prompts,
)


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


def test_chat_message_prompts_load_from_jsonl_and_parquet_and_render_with_the_template(tmp_path):
    from miles_core.chat import prompt_tokens
    from miles_core.models.tiny import build_tokenizer

    messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "1+2="}]
    jsonl = write_lines(tmp_path / "chat.jsonl", [json.dumps({"input": messages, "label": "3"})])
    pq.write_table(pa.table({"input": [messages], "label": ["3"]}), tmp_path / "chat.parquet")
    (from_jsonl,), (from_parquet,) = load_prompts(jsonl), load_prompts(tmp_path / "chat.parquet")
    assert from_jsonl.text == from_parquet.text == messages
    tokenizer = build_tokenizer()
    rendered = tokenizer.decode(prompt_tokens(tokenizer, from_jsonl.text))
    assert rendered == "<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"


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


def test_batch_larger_than_the_prompt_file_is_refused_naming_both_sizes():
    source = PromptSource(make_prompts(3), seed=0)
    with pytest.raises(ValueError, match="a batch of 8 prompts cannot be drawn from 3 prompts"):
        source.next_batch(8)
    assert source.state == DataState(0, 0)  # a refused draw consumes nothing
    assert len({p.id for p in source.next_batch(3)}) == 3  # the whole file is the largest batch


def draw_steps(source, steps, per_step):
    return [[p.id for p in source.next_batch(per_step)] for _ in range(steps)]


@pytest.mark.parametrize("n_prompts,per_step,steps", [(10, 4, 20), (4000, 64, 130), (7, 3, 30), (5, 3, 20), (2, 1, 9), (1, 1, 4)])
def test_no_batch_repeats_a_prompt_and_every_epoch_covers_the_file(n_prompts, per_step, steps):
    """Sizes that are not multiples of the step: batches span epoch boundaries. With per_step <=
    n_prompts // 2 + 1 nothing is skipped, so the stream cut into epochs of n_prompts draws holds
    each prompt exactly once per epoch."""
    source = PromptSource(make_prompts(n_prompts), seed=0)
    batches = draw_steps(source, steps, per_step)
    assert all(len(set(b)) == len(b) == per_step for b in batches)
    stream = [i for b in batches for i in b]
    full = len(stream) // n_prompts
    epochs = [stream[e * n_prompts : (e + 1) * n_prompts] for e in range(full)]
    assert all(sorted(e) == sorted(f"p{i}" for i in range(n_prompts)) for e in epochs)
    # steps * per_step draws = `full` epochs and a remainder
    assert source.state == DataState(epoch=full, offset=len(stream) - full * n_prompts)


def test_the_default_recipe_crosses_its_first_epoch_boundary():
    """4000 prompts, 64 per step: step 63 takes the last 32 of epoch 0 and the first 32 of epoch 1
    (62 * 64 = 3968). With seed 0 a plain reshuffle put one prompt in both halves."""
    source = PromptSource(make_prompts(4000), seed=0)
    for _ in range(62):
        source.next_batch(64)
    assert source.state == DataState(0, 3968)
    crossing = [p.id for p in source.next_batch(64)]
    assert len(set(crossing)) == 64 and source.state == DataState(1, 32)


def test_consecutive_draws_up_to_half_the_file_never_repeat():
    """Dynamic sampling draws several batches per step: any window of n // 2 + 1 consecutive draws is repeat-free."""
    source = PromptSource(make_prompts(9), seed=5)
    stream = [p.id for _ in range(60) for p in source.next_batch(1)]
    assert all(len(set(stream[i : i + 5])) == 5 for i in range(len(stream) - 4))


def test_a_batch_over_half_the_file_that_would_span_epochs_starts_the_next_epoch():
    """6 prompts, window 3: a batch of 5 at offset 4 (2 left) skips them and takes 5 of epoch 1."""
    source = PromptSource(make_prompts(6), seed=1, state=DataState(0, 4))
    batch = [p.id for p in source.next_batch(5)]
    assert len(set(batch)) == 5 and source.state == DataState(1, 5)
    assert batch == [p.id for p in PromptSource(make_prompts(6), seed=1, state=DataState(1, 0)).next_batch(5)]


def test_order_depends_only_on_seed_and_epoch():
    prompts = make_prompts(10)
    by_steps = PromptSource(prompts, seed=2)
    draw_steps(by_steps, 7, 4)  # 28 draws: epoch 2, offset 8
    by_ones = PromptSource(prompts, seed=2)
    draw_steps(by_ones, 28, 1)
    assert by_steps.state == by_ones.state == DataState(2, 8)
    assert draw_steps(by_steps, 5, 2) == draw_steps(by_ones, 5, 2)


@pytest.mark.parametrize("stop_after", [0, 1, 2, 5])
def test_resume_from_state_equals_continuing(stop_after):
    prompts = make_prompts(10)
    original = PromptSource(prompts, seed=11)
    for _ in range(stop_after):
        original.next_batch(4)
    resumed = PromptSource(prompts, seed=11, state=original.state)
    for _ in range(12):  # 48 more draws: four more epoch boundaries
        assert original.next_batch(4) == resumed.next_batch(4)
    assert original.state == resumed.state


def test_invalid_source_arguments():
    with pytest.raises(ValueError):
        PromptSource([], seed=0)
    with pytest.raises(ValueError):
        PromptSource(make_prompts(3), seed=0, state=DataState(epoch=0, offset=3))
    with pytest.raises(ValueError):
        PromptSource(make_prompts(3), seed=0).next_batch(0)
    with pytest.raises(ValueError):
        PromptSource(make_prompts(3), seed=0, state=DataState(epoch=-1, offset=0))
