"""Rollout batches as parquet files: written atomically once checked, read back checked (miles_core/schemas.py).

A process remembers the contents it wrote or read and checked (a digest of the parquet bytes, with the checks they
passed, the newest REMEMBERED): reading back what a task before it in the same process wrote skips checking the same
bytes again. A pod reads what another pod wrote and checks it; bytes that differ in any way are checked. The samples
come from the arrow table read (`samples.from_table`: each column as Python values at once, not pandas' array per row).
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pyarrow
import pyarrow.parquet as pq

from miles_core.recent import Recent
from miles_core.samples import Sample, from_table, to_frame
from miles_core.schemas import BatchError, check_batch
from miles_core.storage import atomic_file

REMEMBERED = 64
_checked = Recent(REMEMBERED)  # (digest, checks) of the contents checked


def _contents(data: bytes, checks: tuple) -> tuple:
    return hashlib.blake2b(data, digest_size=16).digest(), checks


def write_batch(
    samples: list[Sample],
    path: str | Path,
    scored: bool = False,
    reward_range: tuple[float, float] | None = None,
    vocab_size: int | None = None,
    group_size: int | None = None,
    distilled: bool = False,
) -> Path:
    """Check the batch, then write it as parquet atomically (a refused batch leaves `path` as it was)."""
    checks = (scored, reward_range, vocab_size, group_size, distilled)
    frame = check_batch(to_frame(samples), str(path), *checks)
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    data = buffer.getvalue()
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)
    _checked.kept(_contents(data, checks), lambda: None)
    return Path(path)


def read_batch(
    path: str | Path,
    scored: bool = False,
    reward_range: tuple[float, float] | None = None,
    vocab_size: int | None = None,
    group_size: int | None = None,
    distilled: bool = False,
) -> list[Sample]:
    """Read a parquet batch and check it before anything uses it; the file itself is never changed."""
    checks = (scored, reward_range, vocab_size, group_size, distilled)
    try:
        data = Path(path).read_bytes()
        table = pq.read_table(pyarrow.BufferReader(data))
    except (pyarrow.ArrowException, OSError, ValueError) as err:  # what pyarrow raises for missing or unreadable files
        raise BatchError(f"batch {path}: not a readable parquet file ({type(err).__name__}: {str(err)[:200]})") from None
    contents = _contents(data, checks)
    if contents not in _checked:
        check_batch(table.to_pandas(), str(path), *checks)
    _checked.kept(contents, lambda: None)
    return from_table(table)
