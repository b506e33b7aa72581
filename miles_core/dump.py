"""A rollout batch as a readable dataset, and such a dataset read back as a batch to train on (docs/debug.md).

`readable_frame` turns a scored batch into one row per sample: the prompt and response decoded with the
policy's tokenizer, and where a train step computed them the per-token advantages and the trainer's log-probs
(`step.optimize`'s trace), beside every column of the batch itself (`miles_core.samples.to_frame`). `write_dump`
writes it as parquet and as JSONL (one JSON object a line). Because the batch's own columns are there,
`read_rollouts` trains on a dump again, or on a user's file of the same columns: the readable ones (`READABLE`) are
derived and dropped, every other row is checked where it enters (its keys and scalar types here, row by row, then
`schemas.check_batch`), and a bad one is refused naming the file, the 1-based row (the line for JSONL) and the column.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow
import pyarrow.parquet as pq

from miles_core.samples import COLUMNS, Sample, from_frame, sample_id_of, to_frame
from miles_core.schemas import BatchError, check_batch
from miles_core.storage import atomic_dir

READABLE = ("prompt", "response", "response_length", "advantages", "trainer_logprobs")  # derived: never read back
# a user's file may leave out the metadata and the per-token columns a batch may hold empty (routing, teacher log-probs)
OPTIONAL = {"metadata": "{}", **{f.name: [] for f in fields(Sample) if f.default_factory is list}}
# the scalar columns a row must hold, with what each must be (checked per row, so a bad cell names its row)
SCALARS = {"prompt_id": str, "index": int, "finish_reason": str, "weight_version": int, "label": str, "reward": float}
PARQUET, JSONL = "rollouts.parquet", "rollouts.jsonl"


def readable_frame(samples: list[Sample], tokenizer, trace: dict | None = None) -> pd.DataFrame:
    """One row per sample: sample id, weight version, prompt and response text, reward, response length, per-token
    advantages and trainer log-probs ([T] each, None where no train step ran: `trace` from `step.optimize`), then
    the batch's columns (token ids, rollout log-probs, loss mask, label, metadata...)."""
    frame = to_frame(samples)
    lengths = [len(s.response_tokens) for s in samples]
    readable = pd.DataFrame(
        {
            "prompt": [tokenizer.decode(s.prompt_tokens) for s in samples],
            "response": [tokenizer.decode(s.response_tokens, skip_special_tokens=True) for s in samples],
            "response_length": lengths,
            "advantages": per_token(trace, "advantages", lengths),
            "trainer_logprobs": per_token(trace, "trainer_logprobs", lengths),
        }
    )
    ordered = ["sample_id", "weight_version", "prompt", "response", "reward", *READABLE[2:]]
    return pd.concat([frame, readable], axis=1)[ordered + [c for c in frame.columns if c not in ordered]]


def per_token(trace: dict | None, key: str, lengths: list[int]) -> list:
    """Each sample's own T values of a padded [B, T] tensor of the trace, or None per sample without one."""
    if not trace or key not in trace:
        return [None] * len(lengths)
    values = trace[key].detach().float().cpu()
    return [values[i, :n].tolist() for i, n in enumerate(lengths)]


def write_dump(frame: pd.DataFrame, out_dir: str | Path) -> Path:
    """The readable frame as `rollouts.parquet` and `rollouts.jsonl` in out_dir (written whole, or not at all)."""
    with atomic_dir(out_dir) as tmp:
        frame.to_parquet(tmp / PARQUET, index=False)
        with open(tmp / JSONL, "w", encoding="utf-8") as f:
            for row in frame.to_dict(orient="records"):
                f.write(json.dumps(row, default=_plain) + "\n")
    return Path(out_dir)


def _plain(value):
    """JSON for what pandas rows hold besides plain values: numpy arrays and scalars."""
    return value.tolist() if isinstance(value, (np.ndarray, np.generic)) else str(value)


def read_rollouts(
    path: str | Path,
    reward_range: tuple[float, float] | None = None,
    vocab_size: int | None = None,
    group_size: int | None = None,
    name: str | None = None,
) -> list[Sample]:
    """A scored batch from a dump or a user's file (parquet, else JSONL) of the same columns; a bad row is refused
    with a BatchError naming the file (`name`, default its path), the row and the column. The file is never changed."""
    name = name or str(path)
    try:
        with open(path, "rb") as f:
            parquet = f.read(4) == b"PAR1"
    except OSError as err:
        raise BatchError(f"batch {name}: not readable ({type(err).__name__}: {err})") from None
    rows = _parquet_rows(path, name) if parquet else _jsonl_rows(path, name)
    if not rows:
        raise BatchError(f"batch {name}: no rows")
    frame = pd.DataFrame([_batch_row(name, number, row) for number, row in rows], index=[number for number, _ in rows])
    frame["reward"] = frame["reward"].astype(float)
    return from_frame(check_batch(frame, name, scored=True, reward_range=reward_range, vocab_size=vocab_size, group_size=group_size))


def _jsonl_rows(path, name: str) -> list[tuple[int, object]]:
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append((number, json.loads(line)))
            except ValueError as err:
                raise BatchError(f"batch {name}: row {number}: not JSON ({err})") from None
    return rows


def _parquet_rows(path, name: str) -> list[tuple[int, object]]:
    try:
        return list(enumerate(pq.read_table(path).to_pylist(), start=1))
    except (pyarrow.ArrowException, OSError, ValueError) as err:  # what pyarrow raises for unreadable files
        raise BatchError(f"batch {name}: not a readable parquet file ({type(err).__name__}: {str(err)[:200]})") from None


def _batch_row(name: str, number: int, row) -> dict:
    """The batch columns of one row, with the optional ones filled in and its scalars checked."""
    where = f"batch {name}: row {number}"
    if not isinstance(row, dict):
        raise BatchError(f"{where}: expected an object of columns, got {type(row).__name__}")
    out = {**OPTIONAL, **{k: v for k, v in row.items() if k not in READABLE}}
    missing = [c for c in COLUMNS if out.get(c) is None]  # absent, or null (JSON null; a parquet column another row fills)
    if missing:
        raise BatchError(f"{where}: column {missing[0]}: missing (columns: {', '.join(sorted(row))[:300]})")
    for column, kind in SCALARS.items():
        if not _is(out[column], kind):
            raise BatchError(f"{where}: column {column}: expected {kind.__name__}, got {str(out[column])[:80]!r}")
        if kind is int:  # a parquet integer column with nulls in other rows holds floats
            out[column] = int(out[column])
    if isinstance(out["metadata"], dict):  # a user's file may give it as an object; the batch holds it as JSON text
        out["metadata"] = json.dumps(out["metadata"], sort_keys=True)
    out.setdefault("sample_id", sample_id_of(out["prompt_id"], out["index"]))
    return out


def _is(value, kind: type) -> bool:
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    if kind is int:
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, kind)
