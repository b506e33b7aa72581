"""Prompt data: loading jsonl/parquet prompt files and a resumable, shuffled prompt stream.

A prompt file holds one row per prompt with an input (the user turn as text, or a list of chat
messages `{"role": system|user|assistant|tool, "content": text}` ending on a user or tool turn,
rendered with the model's own chat template), a label (what the reward
function checks against) and optional metadata (a dict handed to the reward function).  Every
row is checked on load and the first bad one fails with a `DataError` naming the file, the
1-based row (the line number for jsonl), the key and the reason, before any rollout starts.
The file's size, each line's length and the metadata's nesting are capped, so a hostile file
costs bounded memory and gives a short error, never a traceback from the JSON or parquet reader.
An integer label too long for Python's int conversion keeps its exact digits.

`PromptSource` walks a fresh permutation of the prompts each epoch.  Its position is a
`DataState` (epoch, offset), which is all a checkpoint needs to resume the exact same stream.
"""

from __future__ import annotations

import json
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

MAX_FILE_BYTES = 4 << 30  # a prompt file larger than this is refused before reading
MAX_LINE_BYTES = 1 << 20  # one jsonl line (one prompt with its metadata)
MAX_DEPTH = 32  # nesting of lists and dicts inside a row's metadata


class DataError(ValueError):
    """A prompt file or row is wrong; the message names the file, the row, the key and why."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str | list[dict]  # the user turn, or chat messages rendered with the model's chat template
    label: str
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DataState:
    """Position in the prompt stream: the epoch and how many prompts of it were consumed."""

    epoch: int = 0
    offset: int = 0


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _int_literal(digits: str):
    # json.loads raises a bare ValueError past Python's int conversion limit: keep the exact digits instead.
    limit = sys.get_int_max_str_digits() or len(digits)
    return int(digits) if len(digits.lstrip("-")) <= limit else digits


def _unique_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        raise DataError(f"duplicate key {_short(next(k for k in keys if keys.count(k) > 1))}")
    return dict(pairs)


def _json_row(line: bytes, where: str):
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: invalid UTF-8 at byte {err.start} of the line") from None
    try:
        return json.loads(text, parse_int=_int_literal, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: invalid JSON: {err.msg} (column {err.colno})") from None
    except DataError as err:
        raise DataError(f"{where}: {err}") from None
    except RecursionError:
        raise DataError(f"{where}: nested deeper than JSON can be read") from None


def _read_jsonl(path: Path, max_line_bytes: int):
    """(line number, row) pairs; blank lines are skipped, a bad line fails at its number."""
    with path.open("rb") as f:
        number = 0
        while line := f.readline(max_line_bytes + 1):
            number += 1
            if len(line) > max_line_bytes and not line.endswith(b"\n"):
                raise DataError(f"{path}: row {number}: line longer than {max_line_bytes} bytes")
            if number == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
            if line.strip():
                yield number, _json_row(line, f"{path}: row {number}")


def _read_parquet(path: Path, max_line_bytes: int):
    import pyarrow as pa  # only parquet prompt files need it
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError, ValueError) as err:  # the types pyarrow raises for unreadable files
        raise DataError(f"{path}: not a readable parquet file ({type(err).__name__}: {str(err)[:200]})") from None
    return enumerate(rows, start=1)


_READERS = {".jsonl": _read_jsonl, ".parquet": _read_parquet}


def _check_value(value, where: str, depth: int = 0) -> None:
    """Metadata must be plain JSON: nesting within MAX_DEPTH, strings encodable as UTF-8, finite numbers."""
    if depth > MAX_DEPTH:
        raise DataError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        _check_text(value, where)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise DataError(f"{where}: not a finite number ({value!r})")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise DataError(f"{where}: keys must be strings, got {_short(key)}")
            _check_text(key, where)
            _check_value(item, where, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_value(item, where, depth + 1)
    elif value is not None and not isinstance(value, (bool, int)):
        raise DataError(f"{where}: a {type(value).__name__} is not a JSON value")


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate (\ud800 in JSON) would fail later, in the tokenizer or parquet
        raise DataError(f"{where}: string holds an unpaired surrogate at character {err.start}") from None


def _label_text(value, where: str) -> str:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: label is an empty string")
        _check_text(value, where)
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise DataError(f"{where}: label is not a finite number ({value!r})")
        # 132.0 from a float column means the integer label 132.
        return str(int(value)) if value.is_integer() else repr(value)
    kind = "missing (null)" if value is None else f"a {type(value).__name__}"
    raise DataError(f"{where}: label must be a string or a number, got {kind}")


CHAT_ROLES = ("system", "user", "assistant", "tool")


def _input(value, where: str) -> str | list[dict]:
    """The prompt: a non-empty text (the user turn), or chat messages ({"role", "content"}) that end on a user or tool turn."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: input must be a non-empty string or a list of chat messages, got {_short(value)}")
        _check_text(value, where)
        return value
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: input must be a non-empty string or a list of chat messages, got {_short(value)}")
    for number, message in enumerate(value):
        at = f"{where}: message {number}"
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise DataError(f"{at}: expected an object with exactly the keys role and content, got {_short(message)}")
        if message["role"] not in CHAT_ROLES:
            raise DataError(f"{at}: key 'role': must be one of {', '.join(CHAT_ROLES)}, got {_short(message['role'])}")
        if not isinstance(message["content"], str):
            raise DataError(f"{at}: key 'content': must be a string, got {_short(message['content'])}")
        _check_text(message["content"], f"{at}: key 'content'")
    if value[-1]["role"] not in ("user", "tool"):
        raise DataError(f"{where}: the last message must be a user or tool turn (the policy answers it), got {value[-1]['role']!r}")
    return value


def _parse_row(path: Path, number: int, row, keys: tuple[str, str, str]) -> Prompt:
    input_key, label_key, metadata_key = keys
    where = f"{path}: row {number}"
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key, what in ((input_key, "input"), (label_key, "label")):
        if key not in row:
            raise DataError(f"{where}: key {key!r}: missing {what} key (keys: {_short(sorted(row))})")
    text = _input(row[input_key], f"{where}: key {input_key!r}")
    label = _label_text(row[label_key], f"{where}: key {label_key!r}")
    metadata = row.get(metadata_key)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise DataError(f"{where}: key {metadata_key!r}: metadata must be a dict, got {type(metadata).__name__}")
    _check_value(metadata, f"{where}: key {metadata_key!r}")
    prompt_id = metadata.get("id", f"{path.stem}-{number}")
    if not isinstance(prompt_id, (str, int)) or isinstance(prompt_id, bool) or not str(prompt_id).strip():
        raise DataError(f"{where}: key {metadata_key + '.id'!r}: id must be a non-empty string or an integer, got {_short(prompt_id)}")
    return Prompt(id=str(prompt_id), text=text, label=label, metadata=metadata)


def load_prompts(
    path: str | Path,
    input_key: str = "input",
    label_key: str = "label",
    metadata_key: str = "metadata",
    max_file_bytes: int = MAX_FILE_BYTES,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> list[Prompt]:
    """Read and check every row of a `.jsonl` or `.parquet` prompt file (at most max_file_bytes;
    a jsonl line at most max_line_bytes)."""
    path = Path(path)
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"{path}: unknown prompt file type {_short(path.suffix)} (expected .jsonl or .parquet)")
    if not path.is_file():
        raise DataError(f"{path}: prompt file not found")
    size = path.stat().st_size
    if size > max_file_bytes:
        raise DataError(f"{path}: file of {size} bytes is larger than the {max_file_bytes} bytes allowed")
    prompts: list[Prompt] = []
    first_row: dict[str, int] = {}
    for number, row in reader(path, max_line_bytes):
        prompt = _parse_row(path, number, row, (input_key, label_key, metadata_key))
        if prompt.id in first_row:
            raise DataError(f"{path}: row {number}: key {metadata_key + '.id'!r}: duplicate id {_short(prompt.id)} (first seen in row {first_row[prompt.id]})")
        first_row[prompt.id] = number
        prompts.append(prompt)
    if not prompts:
        raise DataError(f"{path}: the prompt file has no rows")
    return prompts


class PromptSource:
    """Endless batches of prompts: a new seeded permutation each epoch, resumable from `state`.

    The default of the `data.source_fn` plug-point: `source_fn(prompts, seed, state)` returns an
    object with `next_batch(n) -> list[Prompt]` and a `state -> DataState` property from which an
    equal source can be rebuilt (so a resumed run neither repeats nor skips prompts).

    A batch never holds a prompt twice (its samples would share sample ids), also where it spans
    two epochs: epoch e's order is `_permutation(e)` with the prompts of epoch e-1's last `window`
    places moved out of its first `window` places (window = len(prompts) // 2), a pure function of
    (seed, epoch). Any run of up to window + 1 consecutive draws, one batch or several (dynamic-
    sampling rounds, a step's buffer), is therefore free of repeats. A larger batch that would span
    the boundary starts the next epoch instead (the rest of the epoch is skipped, as `drop_last`
    loaders do); a batch larger than the whole prompt file is refused.
    """

    def __init__(self, prompts: list[Prompt], seed: int, state: DataState = DataState()):
        if not prompts:
            raise ValueError("PromptSource needs at least one prompt")
        if not _is_int(state.epoch) or not _is_int(state.offset) or state.epoch < 0 or not 0 <= state.offset < len(prompts):
            raise ValueError(f"data state {state} does not fit {len(prompts)} prompts (needs epoch >= 0 and 0 <= offset < {len(prompts)})")
        self._prompts = list(prompts)
        self._seed = seed
        self._window = len(prompts) // 2
        self._epoch, self._offset = 0, 0
        self._order = self._permutation(0)
        while self._epoch < state.epoch:  # each order depends on the previous one's tail: rebuild them in turn
            self._start_epoch(self._epoch + 1)
        self._offset = state.offset

    def _permutation(self, epoch: int) -> list[int]:
        # Seeded by (seed, epoch) only, so any epoch's order can be rebuilt from the state alone.
        order = list(range(len(self._prompts)))
        random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order

    def _start_epoch(self, epoch: int) -> None:
        """Move on to `epoch`: _permutation(epoch) with the last epoch's last `window` prompts kept out of its first `window` places."""
        order = self._permutation(epoch)
        previous_tail = set(self._order[len(self._order) - self._window :])
        head = [i for i in order if i not in previous_tail][: self._window]
        chosen = set(head)
        self._epoch, self._offset, self._order = epoch, 0, head + [i for i in order if i not in chosen]

    @property
    def state(self) -> DataState:
        return DataState(epoch=self._epoch, offset=self._offset)

    def next_batch(self, n: int) -> list[Prompt]:
        """The next `n` distinct prompts, continuing into the next epoch's order when one runs out."""
        if not _is_int(n) or n <= 0:
            raise ValueError(f"batch size must be an integer > 0, got {n!r}")
        if n > len(self._prompts):
            raise ValueError(
                f"a batch of {n} prompts cannot be drawn from {len(self._prompts)} prompts without repeating one "
                f"(its samples would share sample ids): ask for at most {len(self._prompts)} per draw or give a larger prompt file"
            )
        left = len(self._order) - self._offset
        if n > left and n > self._window + 1:  # the tail and the next head could overlap inside this batch
            self._start_epoch(self._epoch + 1)
        batch: list[Prompt] = []
        while len(batch) < n:
            take = self._order[self._offset : self._offset + n - len(batch)]
            batch.extend(self._prompts[i] for i in take)
            self._offset += len(take)
            if self._offset == len(self._order):
                self._start_epoch(self._epoch + 1)
        return batch


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
