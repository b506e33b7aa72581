"""Prompt data: loading jsonl/parquet prompt files and a resumable, shuffled prompt stream.

A prompt file holds one row per prompt with an input (the user turn), a label (what the reward
function checks against) and optional metadata (a dict handed to the reward function).  Every
row is checked on load and the first bad one fails with a `DataError` naming the file, the
1-based row (the line number for jsonl), the key and the reason, before any rollout starts.

`PromptSource` walks a fresh permutation of the prompts each epoch.  Its position is a
`DataState` (epoch, offset), which is all a checkpoint needs to resume the exact same stream.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path


class DataError(ValueError):
    """A prompt file or row is wrong; the message names the file, the row, the key and why."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    label: str
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DataState:
    """Position in the prompt stream: the epoch and how many prompts of it were consumed."""

    epoch: int = 0
    offset: int = 0


def _read_jsonl(path: Path):
    """(line number, row) pairs; blank lines are skipped, bad JSON fails at its line."""
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: row {number}: invalid JSON: {err.msg} (column {err.colno})") from None


def _read_parquet(path: Path):
    import pyarrow.parquet as pq  # only parquet prompt files need it

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises several types for unreadable files
        raise DataError(f"{path}: not a readable parquet file: {err}") from None
    return enumerate(rows, start=1)


_READERS = {".jsonl": _read_jsonl, ".parquet": _read_parquet}


def _label_text(value, where: str) -> str:
    if isinstance(value, str):
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


def _parse_row(path: Path, number: int, row, keys: tuple[str, str, str]) -> Prompt:
    input_key, label_key, metadata_key = keys
    where = f"{path}: row {number}"
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if input_key not in row:
        raise DataError(f"{where}: key {input_key!r}: missing input key (keys: {sorted(row)})")
    if label_key not in row:
        raise DataError(f"{where}: key {label_key!r}: missing label key (keys: {sorted(row)})")
    text = row[input_key]
    if not isinstance(text, str) or not text.strip():
        raise DataError(f"{where}: key {input_key!r}: input must be a non-empty string, got {text!r}")
    label = _label_text(row[label_key], f"{where}: key {label_key!r}")
    metadata = row.get(metadata_key)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise DataError(f"{where}: key {metadata_key!r}: metadata must be a dict, got {type(metadata).__name__}")
    prompt_id = metadata.get("id", f"{path.stem}-{number}")
    if not isinstance(prompt_id, (str, int)) or isinstance(prompt_id, bool):
        raise DataError(f"{where}: key {metadata_key + '.id'!r}: id must be a string or an integer, got {prompt_id!r}")
    return Prompt(id=str(prompt_id), text=text, label=label, metadata=metadata)


def load_prompts(
    path: str | Path, input_key: str = "input", label_key: str = "label", metadata_key: str = "metadata"
) -> list[Prompt]:
    """Read and check every row of a `.jsonl` or `.parquet` prompt file."""
    path = Path(path)
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"{path}: unknown prompt file type {path.suffix!r} (expected .jsonl or .parquet)")
    if not path.is_file():
        raise DataError(f"{path}: prompt file not found")
    prompts: list[Prompt] = []
    first_row: dict[str, int] = {}
    for number, row in reader(path):
        prompt = _parse_row(path, number, row, (input_key, label_key, metadata_key))
        if prompt.id in first_row:
            raise DataError(
                f"{path}: row {number}: key {metadata_key + '.id'!r}: duplicate id {prompt.id!r} "
                f"(first seen in row {first_row[prompt.id]})"
            )
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
    """

    def __init__(self, prompts: list[Prompt], seed: int, state: DataState = DataState()):
        if not prompts:
            raise ValueError("PromptSource needs at least one prompt")
        if state.epoch < 0 or not 0 <= state.offset < len(prompts):
            raise ValueError(f"data state {state} does not fit {len(prompts)} prompts")
        self._prompts = list(prompts)
        self._seed = seed
        self._epoch, self._offset = state.epoch, state.offset
        self._order = self._permutation(self._epoch)

    def _permutation(self, epoch: int) -> list[int]:
        # Seeded by (seed, epoch) only, so any epoch's order can be rebuilt from the state alone.
        order = list(range(len(self._prompts)))
        random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order

    @property
    def state(self) -> DataState:
        return DataState(epoch=self._epoch, offset=self._offset)

    def next_batch(self, n: int) -> list[Prompt]:
        """The next `n` prompts, continuing into the next epoch's permutation when one runs out."""
        if n <= 0:
            raise ValueError(f"batch size must be > 0, got {n}")
        batch: list[Prompt] = []
        while len(batch) < n:
            take = self._order[self._offset : self._offset + n - len(batch)]
            batch.extend(self._prompts[i] for i in take)
            self._offset += len(take)
            if self._offset == len(self._order):
                self._epoch, self._offset = self._epoch + 1, 0
                self._order = self._permutation(self._epoch)
        return batch
