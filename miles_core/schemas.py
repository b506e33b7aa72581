"""pandera schemas of rollout batches, checked where a batch crosses a task boundary.

`RolloutBatchSchema` is what a rollout writes; `ScoredBatchSchema` adds a finite reward.
`check_batch` runs the schema lazily (every failure at once) and raises `BatchError` naming the
file, the rows (with their sample ids), the column and the check that failed.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pandera.pandas as pa
from pandera.errors import SchemaErrors
from pandera.typing import Series

from miles_core.samples import Sample, from_frame, to_frame
from miles_core.storage import atomic_file


class BatchError(ValueError):
    """A rollout batch broke its schema; the message names file, rows, column and check."""


class RolloutBatchSchema(pa.DataFrameModel):
    sample_id: Series[str] = pa.Field(unique=True)
    prompt_id: Series[str]
    index: Series[int] = pa.Field(ge=0)
    prompt_tokens: Series[object]
    response_tokens: Series[object]
    rollout_logprobs: Series[object]
    loss_mask: Series[object]
    finish_reason: Series[str] = pa.Field(isin=["stop", "length", "abort"])
    weight_version: Series[int] = pa.Field(ge=0)
    label: Series[str]
    metadata: Series[str]
    reward: Series[float] = pa.Field(nullable=True)

    @pa.check("prompt_tokens", "response_tokens", element_wise=True, name="non_empty")
    def non_empty(cls, tokens) -> bool:
        return len(tokens) > 0

    @pa.check("rollout_logprobs", element_wise=True, name="finite_logprobs")
    def finite_logprobs(cls, values) -> bool:
        return all(math.isfinite(x) and x <= 1e-4 for x in values)

    @pa.check("loss_mask", element_wise=True, name="binary_mask")
    def binary_mask(cls, values) -> bool:
        return all(m in (0, 1) for m in values)

    @pa.dataframe_check(name="aligned_lengths")
    def aligned_lengths(cls, df: pd.DataFrame) -> Series[bool]:
        """response_tokens, rollout_logprobs and loss_mask have one entry per response token."""
        n = df["response_tokens"].map(len)
        return (n == df["rollout_logprobs"].map(len)) & (n == df["loss_mask"].map(len))

    class Config:
        strict = True


class ScoredBatchSchema(RolloutBatchSchema):
    reward: Series[float] = pa.Field(nullable=False)

    @pa.check("reward", name="finite_reward")
    def finite_reward(cls, reward: Series[float]) -> Series[bool]:
        return reward.map(math.isfinite)


def check_batch(frame: pd.DataFrame, source: str, scored: bool = False, reward_range: tuple[float, float] | None = None) -> pd.DataFrame:
    """Validate a batch read from or written to `source`; raise BatchError naming what is wrong."""
    schema = ScoredBatchSchema if scored else RolloutBatchSchema
    try:
        schema.validate(frame, lazy=True)
    except SchemaErrors as err:
        raise BatchError(f"batch {source}: {_describe(err, frame)}") from None
    if reward_range is not None:
        low, high = reward_range
        bad = frame.index[(frame["reward"] < low) | (frame["reward"] > high)]
        if len(bad):
            row = bad[0]
            raise BatchError(
                f"batch {source}: row {row} (sample {frame.at[row, 'sample_id']}): column reward = "
                f"{frame.at[row, 'reward']} outside [{low}, {high}] ({len(bad)} row(s) out of range)"
            )
    return frame


def _describe(err: SchemaErrors, frame: pd.DataFrame) -> str:
    lines = []
    for check, group in err.failure_cases.groupby("check", dropna=False, sort=False):
        columns = group["column"].dropna().unique().tolist()
        rows = sorted({int(i) for i in group["index"].dropna()})
        ids = [str(frame.at[i, "sample_id"]) for i in rows[:5] if "sample_id" in frame and i in frame.index]
        what = f"column {columns[0]}" if len(columns) == 1 else "row"
        where = f"rows {rows[:5]} (samples {ids})" if rows else f"{group['failure_case'].tolist()[:5]}"
        lines.append(f"{what}: check {check!r} failed at {where}")
    return "; ".join(lines)


def write_batch(samples: list[Sample], path: str | Path, scored: bool = False, reward_range: tuple[float, float] | None = None) -> Path:
    """Check the batch, then write it as parquet atomically."""
    frame = check_batch(to_frame(samples), str(path), scored, reward_range)
    with atomic_file(path) as tmp:
        frame.to_parquet(tmp, index=False)
    return Path(path)


def read_batch(path: str | Path, scored: bool = False, reward_range: tuple[float, float] | None = None) -> list[Sample]:
    """Read a parquet batch and check it before anything uses it."""
    return from_frame(check_batch(pd.read_parquet(path), str(path), scored, reward_range))
