"""Malformed prompt files, generated here: each is refused with a short DataError naming the file,
the 1-based row (jsonl: the line) and the key, never a traceback from json or pyarrow."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_core.data.source import MAX_DEPTH, DataError, load_prompts

GOOD = b'{"input": "1+1=", "label": "2", "metadata": {"id": "first"}}'


def nested(depth, leaf="x"):
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


def deep_text(depth):
    return "[" * depth + "]" * depth


# (name, bad line placed at line 2 after GOOD, key named in the error or None, reason)
JSONL_ROWS = [
    ("utf8-invalid-byte", b'{"input": "\xff\xfe", "label": "1"}', None, "invalid UTF-8"),
    ("utf8-truncated-sequence", b'{"input": "caf\xc3", "label": "1"}', None, "invalid UTF-8"),
    ("latin1", '{"input": "café", "label": "1"}'.encode("latin-1"), None, "invalid UTF-8"),
    ("utf8-overlong-encoding", b'{"input": "\xc0\xaf", "label": "1"}', None, "invalid UTF-8"),
    ("utf8-encoded-surrogate", b'{"input": "\xed\xa0\x80", "label": "1"}', None, "invalid UTF-8"),
    ("label-infinite", b'{"input": "1+1=", "label": 1e999}', "label", "not a finite number"),
    ("label-nan", b'{"input": "1+1=", "label": NaN}', "label", "not a finite number"),
    ("label-minus-infinity", b'{"input": "1+1=", "label": -Infinity}', "label", "not a finite number"),
    ("label-null", b'{"input": "1+1=", "label": null}', "label", "missing (null)"),
    ("label-list", b'{"input": "1+1=", "label": [2]}', "label", "string or a number"),
    ("label-object", b'{"input": "1+1=", "label": {"v": 2}}', "label", "string or a number"),
    ("label-true", b'{"input": "1+1=", "label": true}', "label", "string or a number"),
    ("label-false", b'{"input": "1+1=", "label": false}', "label", "string or a number"),
    ("label-empty", b'{"input": "1+1=", "label": ""}', "label", "empty string"),
    ("label-blank", b'{"input": "1+1=", "label": "  "}', "label", "empty string"),
    ("label-lone-surrogate", b'{"input": "1+1=", "label": "\\ud800"}', "label", "unpaired surrogate"),
    ("label-missing", b'{"input": "1+1="}', "label", "missing label key"),
    ("input-missing", b'{"label": "2"}', "input", "missing input key"),
    ("input-empty", b'{"input": "", "label": "2"}', "input", "non-empty string"),
    ("input-blank", b'{"input": " \\n\\t", "label": "2"}', "input", "non-empty string"),
    ("input-number", b'{"input": 5, "label": "2"}', "input", "non-empty string"),
    ("input-list-of-text", b'{"input": ["1+1="], "label": "2"}', "input", "message 0: expected an object with exactly the keys role and content"),
    ("messages-empty", b'{"input": [], "label": "2"}', "input", "non-empty string or a list of chat messages"),
    ("messages-role", b'{"input": [{"role": "root", "content": "1+1="}], "label": "2"}', "input", "message 0: key 'role': must be one of system, user"),
    ("messages-content", b'{"input": [{"role": "user", "content": ["1+1="]}], "label": "2"}', "input", "message 0: key 'content': must be a string"),
    ("messages-extra-key", b'{"input": [{"role": "user", "content": "1", "name": "x"}], "label": "2"}', "input", "exactly the keys role and content"),
    ("messages-missing-content", b'{"input": [{"role": "user"}], "label": "2"}', "input", "exactly the keys role and content"),
    (
        "messages-surrogate",
        b'{"input": [{"role": "user", "content": "\\ud800"}], "label": "2"}',
        "input",
        "message 0: key 'content': string holds an unpaired surrogate",
    ),
    (
        "messages-end-on-assistant",
        b'{"input": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}], "label": "2"}',
        "input",
        "the last message must be a user or tool turn",
    ),
    ("input-object", b'{"input": {"text": "1+1="}, "label": "2"}', "input", "non-empty string"),
    ("input-null", b'{"input": null, "label": "2"}', "input", "non-empty string"),
    ("input-true", b'{"input": true, "label": "2"}', "input", "non-empty string"),
    ("input-lone-surrogate", b'{"input": "a\\udfffb", "label": "2"}', "input", "unpaired surrogate"),
    (
        "input-deep-list",
        json.dumps({"input": json.loads(deep_text(50)), "label": "2"}).encode(),
        "input",
        "message 0: expected an object with exactly the keys role and content",
    ),
    (
        "input-long-repr",
        json.dumps({"input": list(range(5000)), "label": "2"}).encode(),
        "input",
        "message 0: expected an object with exactly the keys role and content",
    ),
    ("metadata-list", b'{"input": "1+1=", "label": "2", "metadata": [1]}', "metadata", "must be a dict"),
    ("metadata-string", b'{"input": "1+1=", "label": "2", "metadata": "id=3"}', "metadata", "must be a dict"),
    ("metadata-number", b'{"input": "1+1=", "label": "2", "metadata": 3}', "metadata", "must be a dict"),
    ("metadata-true", b'{"input": "1+1=", "label": "2", "metadata": true}', "metadata", "must be a dict"),
    ("metadata-deep-dict", json.dumps({"input": "1+1=", "label": "2", "metadata": nested(MAX_DEPTH + 5)}).encode(), "metadata", "nested deeper"),
    (
        "metadata-deep-list",
        json.dumps({"input": "1+1=", "label": "2", "metadata": {"a": json.loads(deep_text(MAX_DEPTH + 5))}}).encode(),
        "metadata",
        "nested deeper",
    ),
    ("metadata-nan", b'{"input": "1+1=", "label": "2", "metadata": {"w": NaN}}', "metadata", "not a finite number"),
    ("metadata-infinity", b'{"input": "1+1=", "label": "2", "metadata": {"w": [1, Infinity]}}', "metadata", "not a finite number"),
    ("metadata-lone-surrogate", b'{"input": "1+1=", "label": "2", "metadata": {"note": "\\ud83d"}}', "metadata", "unpaired surrogate"),
    ("metadata-key-surrogate", b'{"input": "1+1=", "label": "2", "metadata": {"\\udc00": 1}}', "metadata", "unpaired surrogate"),
    ("metadata-id-list", b'{"input": "1+1=", "label": "2", "metadata": {"id": [1]}}', "metadata.id", "id must be"),
    ("metadata-id-bool", b'{"input": "1+1=", "label": "2", "metadata": {"id": true}}', "metadata.id", "id must be"),
    ("metadata-id-float", b'{"input": "1+1=", "label": "2", "metadata": {"id": 1.5}}', "metadata.id", "id must be"),
    ("metadata-id-null", b'{"input": "1+1=", "label": "2", "metadata": {"id": null}}', "metadata.id", "id must be"),
    ("metadata-id-empty", b'{"input": "1+1=", "label": "2", "metadata": {"id": " "}}', "metadata.id", "id must be"),
    ("metadata-id-duplicate", b'{"input": "2+2=", "label": "4", "metadata": {"id": "first"}}', "metadata.id", "duplicate id"),
    ("duplicate-key", b'{"input": "1+1=", "input": "2+2=", "label": "4"}', None, "duplicate key 'input'"),
    ("row-list", b"[1, 2]", None, "JSON object"),
    ("row-string", b'"1+1="', None, "JSON object"),
    ("row-number", b"42", None, "JSON object"),
    ("row-null", b"null", None, "JSON object"),
    ("row-true", b"true", None, "JSON object"),
    ("json-truncated", b'{"input": "1+1=", "label": "2"', None, "invalid JSON"),
    ("json-trailing-comma", b'{"input": "1+1=", "label": "2",}', None, "invalid JSON"),
    ("json-single-quotes", b"{'input': '1+1=', 'label': '2'}", None, "invalid JSON"),
    ("json-two-objects", b'{"input": "1+1=", "label": "2"} {"input": "x", "label": "1"}', None, "invalid JSON"),
    ("json-unquoted-key", b'{input: "1+1=", "label": "2"}', None, "invalid JSON"),
    ("json-comment", b'{"input": "1+1=", "label": "2"} // note', None, "invalid JSON"),
    ("json-raw-tab-in-string", b'{"input": "1+\t1=", "label": "2"}', None, "invalid JSON"),
    ("json-nul-byte", b'{"input": "1+1=", "label": "2"}\x00', None, "invalid JSON"),
    ("json-bom-mid-file", b'\xef\xbb\xbf{"input": "1+1=", "label": "2"}', None, "invalid JSON"),
    ("json-deeper-than-the-parser", deep_text(200_000).encode(), None, "nested deeper"),
]


def short_and_named(message, path, *needles):
    assert len(message) < 500, message
    assert str(path) in message, message
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize("name,line,key,reason", JSONL_ROWS, ids=[c[0] for c in JSONL_ROWS])
def test_malformed_jsonl_row(tmp_path, name, line, key, reason):
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(GOOD + b"\n" + line + b"\n")
    with pytest.raises(DataError) as err:
        load_prompts(path)
    message = str(err.value)
    short_and_named(message, path, "row 2", reason, *([repr(key)] if key else []))


def test_an_over_long_line_is_refused_before_it_is_read_whole(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_bytes(GOOD + b"\n\n" + json.dumps({"input": "x" * 5000, "label": "1"}).encode())  # line 3, no final newline
    with pytest.raises(DataError) as err:
        load_prompts(path, max_line_bytes=1000)
    short_and_named(str(err.value), path, "row 3", "longer than 1000 bytes")
    assert len(load_prompts(path, max_line_bytes=10_000)) == 2


def test_a_file_over_the_size_cap_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_bytes(GOOD + b"\n")
    with pytest.raises(DataError) as err:
        load_prompts(path, max_file_bytes=10)
    short_and_named(str(err.value), path, f"file of {len(GOOD) + 1} bytes", "10 bytes allowed")


def test_a_huge_integer_label_keeps_its_exact_digits(tmp_path):
    digits = "9" * 6000  # past Python's 4300-digit int conversion limit
    path = tmp_path / "big_int.jsonl"
    path.write_bytes(b'{"input": "10^6000 - 1 =", "label": ' + digits.encode() + b', "metadata": {"n": -' + digits.encode() + b"}}\n")
    [prompt] = load_prompts(path)
    assert prompt.label == digits and prompt.metadata == {"n": "-" + digits}


def test_plain_json_metadata_is_kept(tmp_path):
    path = tmp_path / "ok.jsonl"
    metadata = {"id": 7, "w": 0.5, "tags": ["a", None, True], "deep": nested(MAX_DEPTH - 1)}
    path.write_text(json.dumps({"input": "1+1=", "label": 2, "metadata": metadata}) + "\n")
    assert load_prompts(path)[0].metadata == metadata


def test_a_byte_order_mark_at_the_start_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD + b"\n")
    assert load_prompts(path)[0].id == "first"


def write_parquet(path, columns):
    pq.write_table(pa.table(columns), path)


PARQUET_TABLES = [
    ("input-int", {"input": [1, 2], "label": ["1", "2"]}, 1, "input", "non-empty string"),
    ("input-null", {"input": ["1+1=", None], "label": ["2", "0"]}, 2, "input", "non-empty string"),
    ("input-binary", {"input": [b"1+1=", b"2+2="], "label": ["2", "4"]}, 1, "input", "non-empty string"),
    ("input-list", {"input": [["a"], ["b"]], "label": ["2", "4"]}, 1, "input", "message 0: expected an object with exactly the keys role and content"),
    ("input-missing", {"question": ["1+1="], "label": ["2"]}, 1, "input", "missing input key"),
    ("label-missing", {"input": ["1+1="], "answer": ["2"]}, 1, "label", "missing label key"),
    ("label-null", {"input": ["1+1=", "2+2="], "label": ["2", None]}, 2, "label", "missing (null)"),
    ("label-bool", {"input": ["1+1="], "label": [True]}, 1, "label", "string or a number"),
    ("label-list", {"input": ["1+1="], "label": [[2]]}, 1, "label", "string or a number"),
    ("label-nan", {"input": ["1+1=", "x"], "label": [2.0, float("nan")]}, 2, "label", "not a finite number"),
    ("label-infinity", {"input": ["1+1="], "label": [float("inf")]}, 1, "label", "not a finite number"),
    ("label-empty", {"input": ["1+1="], "label": [""]}, 1, "label", "empty string"),
    ("label-decimal", {"input": ["1+1="], "label": pa.array([1], pa.decimal128(5, 0))}, 1, "label", "string or a number"),
    ("label-date", {"input": ["1+1="], "label": pa.array([0], pa.date32())}, 1, "label", "string or a number"),
    ("metadata-string", {"input": ["1+1="], "label": ["2"], "metadata": ["{}"]}, 1, "metadata", "must be a dict"),
    ("metadata-list", {"input": ["1+1="], "label": ["2"], "metadata": [[1, 2]]}, 1, "metadata", "must be a dict"),
    ("metadata-deep", {"input": ["1+1="], "label": ["2"], "metadata": [nested(MAX_DEPTH + 3)]}, 1, "metadata", "nested deeper"),
    (
        "metadata-timestamp",
        {"input": ["1+1="], "label": ["2"], "metadata": pa.array([{"t": 0}], pa.struct([("t", pa.timestamp("s"))]))},
        1,
        "metadata",
        "not a JSON value",
    ),
    ("metadata-nan", {"input": ["1+1="], "label": ["2"], "metadata": [{"w": float("nan")}]}, 1, "metadata", "not a finite number"),
    ("metadata-id-bool", {"input": ["1+1="], "label": ["2"], "metadata": [{"id": True}]}, 1, "metadata.id", "id must be"),
    ("metadata-id-duplicate", {"input": ["1+1=", "2+2="], "label": ["2", "4"], "metadata": [{"id": "a"}, {"id": "a"}]}, 2, "metadata.id", "duplicate id"),
]


@pytest.mark.parametrize("name,columns,row,key,reason", PARQUET_TABLES, ids=[c[0] for c in PARQUET_TABLES])
def test_malformed_parquet_row(tmp_path, name, columns, row, key, reason):
    path = tmp_path / f"{name}.parquet"
    write_parquet(path, columns)
    with pytest.raises(DataError) as err:
        load_prompts(path)
    short_and_named(str(err.value), path, f"row {row}", repr(key), reason)


def junk(path):
    path.write_bytes(b"PAR1 not really parquet")


def truncated(path):
    write_parquet(path, {"input": ["1+1="] * 100, "label": ["2"] * 100})
    path.write_bytes(path.read_bytes()[:-40])


def empty_table(path):
    write_parquet(path, {"input": pa.array([], pa.string()), "label": pa.array([], pa.string())})


def text(content):
    return lambda path: path.write_bytes(content)


# (name, file name, writer, reason): errors about the whole file, which has no row to name
WHOLE_FILES = [
    ("parquet-junk", "junk.parquet", junk, "not a readable parquet file"),
    ("parquet-truncated", "cut.parquet", truncated, "not a readable parquet file"),
    ("parquet-no-rows", "none.parquet", empty_table, "no rows"),
    ("jsonl-empty", "empty.jsonl", text(b""), "no rows"),
    ("jsonl-blank-lines", "blank.jsonl", text(b"\n  \n\t\n"), "no rows"),
    ("csv-suffix", "prompts.csv", text(b"input,label\n1+1=,2\n"), "unknown prompt file type"),
    ("json-suffix", "prompts.json", text(b"[]"), "unknown prompt file type"),
    ("directory", "dir.jsonl", lambda path: path.mkdir(), "not found"),
    ("missing", "missing.jsonl", lambda path: None, "not found"),
]


@pytest.mark.parametrize("name,filename,write,reason", WHOLE_FILES, ids=[c[0] for c in WHOLE_FILES])
def test_malformed_whole_file(tmp_path, name, filename, write, reason):
    path = tmp_path / filename
    write(path)
    with pytest.raises(DataError) as err:
        load_prompts(path)
    short_and_named(str(err.value), path, reason)


def test_the_corpus_is_large_enough():
    assert len(JSONL_ROWS) + len(PARQUET_TABLES) + len(WHOLE_FILES) + 2 >= 60
