"""pandera schemas of rollout batches, checked where a batch crosses a task boundary.

`RolloutBatchSchema` is what a rollout writes; `ScoredBatchSchema` adds a finite reward; `DistilledBatchSchema` the
distillation teacher's log-prob of every response token (finite, <= 0, one per token).
`check_batch` runs the schema lazily (every failure at once) and raises `BatchError` naming the
file, the rows (with their sample ids), the column and the check that failed.

Beyond the columns' types: token ids are non-negative integers (below the vocabulary size when
the caller gives it), a sample's id is "<prompt_id>/<index>", one group (one prompt_id) has one
label, and with `group_size` a batch is whole groups: consecutive blocks of group_size samples
of one prompt with indices 0..group_size-1, so no group is split across batches.  Recorded routing (R3) is
non-negative integer expert ids, the same number for every position the engine fed (prompt and response but its
last token) of every sample that has any.
"""

from __future__ import annotations

import contextvars
import itertools
import json
import math

import numpy as np
import pandas as pd
import pandera.pandas as pa
from pandera import dtypes
from pandera.engines import pandas_engine
from pandera.errors import SchemaErrors
from pandera.typing import Series

from miles_core.samples import sample_id_of

TOKEN_COLUMNS = ("prompt_tokens", "response_tokens")
# The checks below see every row, missing values included, and judge one themselves (not a sequence, not a finite
# number): pandera would otherwise look for missing values across the column or the whole frame before each check.
EVERY_ROW = {"ignore_na": False}


class BatchError(ValueError):
    """A rollout batch broke its schema; the message names file, rows, column and check."""


def _integer_ids(tokens) -> np.ndarray | None:
    """The token ids as an int64 array, or None when they are not a sequence of integers (floats, bools, strings)."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64) if tokens.ndim == 1 and tokens.dtype.kind in "iu" else None
    if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in tokens):
        return None
    return np.asarray(tokens, dtype=np.int64) if all(-(2**63) <= t < 2**63 for t in tokens) else None


SEQUENCES = (list, tuple, np.ndarray)


def _sized(values) -> bool:
    return isinstance(values, SEQUENCES)


@pandas_engine.Engine.register_dtype
@dtypes.immutable(init=True)
class Text(pandas_engine.STRING):
    """A column of pandas' string dtype, as the frames of batches hold text. pandera's own (0.35) answers a column of
    that very dtype with a result per row, for which it formats an empty table of failure cases into a message on every
    passing check (~1 ms a column, a fifth of a batch's check); this answers it as one. Any other dtype (an object
    column of a user's file) is checked row by row as before, so the rows that hold something else are named."""

    def check(self, pandera_dtype: dtypes.DataType, data_container: pd.Series | None = None) -> bool | pd.Series:
        if pandas_engine.Engine.dtype(pandera_dtype).type == self.type:
            return True
        return super().check(pandera_dtype, data_container)


class _Flat:
    """A column of number sequences as one array: `values` (every row's, concatenated), `offsets` (where each row
    starts, and the end) and the Python or numpy `types` they have. One pass over the column instead of a Python call
    per number; the checks below use it where every row is a list, tuple or 1-D array of ints, floats or bools, and
    judge each row alone otherwise (what a malformed batch takes, to name its rows)."""

    NUMBERS = (int, float, np.integer, np.floating)  # bool is an int

    def __init__(self, rows: list, kinds: set[type]):
        """rows: lists, tuples or 1-D arrays; kinds: their types."""
        self.offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        self.offsets[1:] = np.cumsum([len(r) for r in rows])
        if all(issubclass(kind, np.ndarray) for kind in kinds):  # as parquet reads a list column
            self.types = frozenset(r.dtype.type for r in rows)
            self.values = np.concatenate(rows) if rows else np.zeros(0)
        else:
            items = list(itertools.chain.from_iterable(rows))
            self.types = frozenset(map(type, items))
            integers = all(issubclass(t, (int, np.integer)) for t in self.types)
            self.values = np.asarray(items, dtype=np.int64 if integers else np.float64) if self.numbers() else np.zeros(0)

    @classmethod
    def of(cls, column: pd.Series) -> _Flat | None:
        """The column as one array, or None when a row is not a list, tuple or 1-D array, or a value is out of int64."""
        rows = column.tolist()
        kinds = set(map(type, rows))
        if not all(issubclass(kind, SEQUENCES) for kind in kinds):
            return None
        if any(issubclass(kind, np.ndarray) for kind in kinds) and any(r.ndim != 1 for r in rows if isinstance(r, np.ndarray)):
            return None
        try:
            return cls(rows, kinds)
        except OverflowError:  # an integer beyond int64
            return None

    def numbers(self) -> bool:
        return all(issubclass(t, self.NUMBERS) for t in self.types)

    def integers(self) -> bool:
        """Every value an integer (not a bool)."""
        return all(issubclass(t, (int, np.integer)) and not issubclass(t, bool) for t in self.types)

    def rows_all(self, ok: np.ndarray, index: pd.Index) -> pd.Series:
        """Per row: `ok` holds for each of its values (an empty row passes)."""
        failed = np.zeros(len(ok) + 1, dtype=np.int64)
        failed[1:] = np.cumsum(~ok)
        return pd.Series(failed[self.offsets[1:]] == failed[self.offsets[:-1]], index=index)


# What the checks of the batch `check_batch` is checking found of each column (its `_Flat`, its rows' lengths), kept
# while it checks: ten checks read the same five sequence columns, each pass over a column a Python loop over its rows.
_found: contextvars.ContextVar[dict | None] = contextvars.ContextVar("found", default=None)


def _once(column: pd.Series, find):
    """`find(column)`, found once per column while `check_batch` checks a frame (callers change nothing they get)."""
    found = _found.get()
    if found is None:
        return find(column)
    key = (find, column.name)
    if key not in found:
        found[key] = find(column)
    return found[key]


def _row_wise(column: pd.Series, fits, vectorized, element) -> pd.Series:
    """A per-row check of a column of number sequences: `vectorized(flat)` when the column flattens and `fits(flat)`,
    else `element(row)` for each row."""
    flat = _once(column, _Flat.of)
    if flat is not None and fits(flat):
        return flat.rows_all(vectorized(flat), column.index)
    return column.map(element).astype(bool)


def _ids_at_least(column: pd.Series, low: int) -> pd.Series:
    """Per row: a sequence of integers (no bools, within int64), each >= low."""
    return _row_wise(
        column, _Flat.integers, lambda flat: flat.values >= low, lambda ids: _integer_ids(ids) is not None and bool((_integer_ids(ids) >= low).all())
    )


class RolloutBatchSchema(pa.DataFrameModel):
    sample_id: Series[Text] = pa.Field(unique=True)
    prompt_id: Series[Text]
    index: Series[int] = pa.Field(ge=0)
    prompt_tokens: Series[object]
    response_tokens: Series[object]
    rollout_logprobs: Series[object]
    loss_mask: Series[object]
    finish_reason: Series[Text] = pa.Field(isin=["stop", "length", "abort"])
    weight_version: Series[int] = pa.Field(ge=0)
    label: Series[Text]
    metadata: Series[Text]
    reward: Series[float] = pa.Field(nullable=True)
    routed_experts: Series[object]
    teacher_logprobs: Series[object]

    @pa.check(*TOKEN_COLUMNS, name="non_empty", **EVERY_ROW)
    def non_empty(cls, tokens: Series[object]) -> Series[bool]:
        return _per_row(tokens, _lengths(tokens) > 0)

    @pa.check(*TOKEN_COLUMNS, name="integer_ids", **EVERY_ROW)
    def integer_ids(cls, tokens: Series[object]) -> Series[bool]:
        return _row_wise(tokens, _Flat.integers, lambda flat: np.ones(len(flat.values), dtype=bool), lambda ids: _integer_ids(ids) is not None)

    @pa.check(*TOKEN_COLUMNS, name="non_negative_ids", **EVERY_ROW)
    def non_negative_ids(cls, tokens: Series[object]) -> Series[bool]:
        # non-integers fail integer_ids already
        return _row_wise(tokens, _Flat.integers, lambda flat: flat.values >= 0, lambda ids: _integer_ids(ids) is None or bool((_integer_ids(ids) >= 0).all()))

    @pa.check("routed_experts", name="expert_ids", **EVERY_ROW)
    def expert_ids(cls, experts: Series[object]) -> Series[bool]:
        return _ids_at_least(experts, 0)

    @pa.check("rollout_logprobs", "teacher_logprobs", name="finite_logprobs", **EVERY_ROW)
    def finite_logprobs(cls, values: Series[object]) -> Series[bool]:
        return _row_wise(values, _Flat.numbers, lambda flat: np.isfinite(flat.values) & (flat.values <= 1e-4), _finite_logprobs)

    @pa.check("loss_mask", name="binary_mask", **EVERY_ROW)
    def binary_mask(cls, values: Series[object]) -> Series[bool]:
        return _row_wise(
            values, lambda flat: flat.numbers() and flat.values.dtype.kind != "f", lambda flat: (flat.values == 0) | (flat.values == 1), _binary_mask
        )

    @pa.check("metadata", name="json_object", **EVERY_ROW)
    def json_object(cls, texts: Series[str]) -> Series[bool]:
        return pd.Series([_json_object(text) for text in texts.tolist()], index=texts.index, dtype=bool)

    @pa.dataframe_check(name="aligned_lengths", **EVERY_ROW)
    def aligned_lengths(cls, df: pd.DataFrame) -> Series[bool]:
        """response_tokens, rollout_logprobs and loss_mask have one entry per response token."""
        if not _has(df, "aligned_lengths"):
            return _passes(df)
        n = _lengths(df["response_tokens"])
        return _per_row(df, (n >= 0) & (n == _lengths(df["rollout_logprobs"])) & (n == _lengths(df["loss_mask"])))

    @pa.dataframe_check(name="teacher_logprobs_aligned", **EVERY_ROW)
    def teacher_logprobs_aligned(cls, df: pd.DataFrame) -> Series[bool]:
        """The teacher's log-probs, where a teacher scored the batch, have one entry per response token."""
        if not _has(df, "teacher_logprobs_aligned"):
            return _passes(df)
        scored = _lengths(df["teacher_logprobs"])
        return _per_row(df, (scored == 0) | (scored == _lengths(df["response_tokens"])))

    @pa.dataframe_check(name="routing_per_position", **EVERY_ROW)
    def routing_per_position(cls, df: pd.DataFrame) -> Series[bool]:
        """Recorded routing has one width (MoE layers x k) for every position fed and every sample, or is empty."""
        if not _has(df, "routing_per_position"):
            return _passes(df)
        fed = _lengths(df["prompt_tokens"]) + _lengths(df["response_tokens"]) - 1
        recorded = _lengths(df["routed_experts"])
        width = recorded // np.maximum(fed, 1)
        widest = width[recorded > 0].max(initial=0)  # the width of every sample that recorded any
        return _per_row(df, (recorded == 0) | ((recorded > 0) & (fed > 0) & (recorded == width * fed) & (width == widest)))

    @pa.dataframe_check(name="sample_id_matches_group", **EVERY_ROW)
    def sample_id_matches_group(cls, df: pd.DataFrame) -> Series[bool]:
        if not _has(df, "sample_id_matches_group"):
            return _passes(df)
        matches = (s == sample_id_of(p, i) for s, p, i in zip(df["sample_id"].tolist(), df["prompt_id"].tolist(), df["index"].tolist()))
        return _per_row(df, np.fromiter(matches, dtype=bool, count=len(df)))

    @pa.dataframe_check(name="one_label_per_group", **EVERY_ROW)
    def one_label_per_group(cls, df: pd.DataFrame) -> Series[bool]:
        if not _has(df, "one_label_per_group"):
            return _passes(df)
        return df.groupby("prompt_id", sort=False)["label"].transform("nunique") == 1

    class Config:
        strict = True


class ScoredBatchSchema(RolloutBatchSchema):
    reward: Series[float] = pa.Field(nullable=False)

    @pa.check("reward", name="finite_reward", **EVERY_ROW)
    def finite_reward(cls, reward: Series[float]) -> Series[bool]:
        return reward.map(lambda r: isinstance(r, (int, float, np.number)) and math.isfinite(r))


class DistilledBatchSchema(ScoredBatchSchema):
    """A scored batch the distillation teacher has scored too: every sample carries the teacher's log-probs."""

    @pa.check("teacher_logprobs", name="teacher_scored", **EVERY_ROW)
    def teacher_scored(cls, values: Series[object]) -> Series[bool]:
        return _per_row(values, _lengths(values) > 0)


# The columns each row-wise check reads: named in its error, and a missing one is reported once, as missing.
ROW_CHECK_COLUMNS = {
    "aligned_lengths": ("response_tokens", "rollout_logprobs", "loss_mask"),
    "teacher_logprobs_aligned": ("response_tokens", "teacher_logprobs"),
    "routing_per_position": ("prompt_tokens", "response_tokens", "routed_experts"),
    "sample_id_matches_group": ("sample_id", "prompt_id", "index"),
    "one_label_per_group": ("prompt_id", "label"),
}


def _has(df: pd.DataFrame, check: str) -> bool:
    return set(ROW_CHECK_COLUMNS[check]) <= set(df.columns)


def _passes(df: pd.DataFrame) -> pd.Series:
    return pd.Series(True, index=df.index)


def _per_row(rows: pd.Series | pd.DataFrame, verdicts: np.ndarray) -> pd.Series:
    """A check's verdict per row, as pandera takes it: on the rows' own index."""
    return pd.Series(verdicts, index=rows.index)


def _lengths(column: pd.Series) -> np.ndarray:
    """Per row: the length of its sequence (a list, tuple or array), -1 where it holds none."""
    return _once(column, _count_lengths)


def _count_lengths(column: pd.Series) -> np.ndarray:
    flat = _once(column, _Flat.of)  # the number checks flatten the same columns: its offsets hold every row's length
    if flat is not None:
        return np.diff(flat.offsets)
    return np.fromiter((len(v) if _sized(v) else -1 for v in column.tolist()), dtype=np.int64, count=len(column))


def _json_object(text) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (TypeError, ValueError, RecursionError):
        return False


def _finite_logprobs(values) -> bool:
    return _sized(values) and all(isinstance(x, (int, float, np.number)) and math.isfinite(x) and x <= 1e-4 for x in values)


def _binary_mask(values) -> bool:
    return _sized(values) and all(not isinstance(m, (float, np.floating)) and m in (0, 1) for m in values)


def check_batch(
    frame: pd.DataFrame,
    source: str,
    scored: bool = False,
    reward_range: tuple[float, float] | None = None,
    vocab_size: int | None = None,
    group_size: int | None = None,
    distilled: bool = False,
) -> pd.DataFrame:
    """Validate a batch read from or written to `source`; raise BatchError naming what is wrong.

    vocab_size: token ids must be below it (the model config's vocab_size: every id the model can emit); group_size: the batch must be whole groups;
    distilled: a scored batch every sample of which carries the teacher's log-probs."""
    schema = DistilledBatchSchema if distilled else ScoredBatchSchema if scored else RolloutBatchSchema
    checking = _found.set({})
    try:
        schema.validate(frame, lazy=True)
        problems = [*_vocabulary_problems(frame, vocab_size), *_group_problems(frame, group_size)]
    except SchemaErrors as err:
        raise BatchError(f"batch {source}: {_describe(err, frame)}") from None
    finally:
        _found.reset(checking)
    if problems:
        raise BatchError(f"batch {source}: {'; '.join(problems[:4])}")
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


def _at(frame: pd.DataFrame, rows: list) -> str:
    """'rows [..] (samples [..])', the first five of them, and how many in all."""
    ids = [str(frame.at[i, "sample_id"]) for i in rows[:5] if "sample_id" in frame and i in frame.index]
    more = f", {len(rows)} rows in all" if len(rows) > 5 else ""
    return f"rows {rows[:5]} (samples {ids}{more})"


def _vocabulary_problems(frame: pd.DataFrame, vocab_size: int | None) -> list[str]:
    if vocab_size is None:
        return []
    problems = []
    for column in TOKEN_COLUMNS:
        below = _row_wise(frame[column], _Flat.integers, lambda flat: flat.values < vocab_size, lambda ids: bool((_integer_ids(ids) < vocab_size).all()))
        rows = below.index[~below.to_numpy()].tolist()
        if rows:
            problems.append(f"column {column}: check 'ids_below_vocab_size({vocab_size})' failed at {_at(frame, rows)}")
    return problems


def _group_problems(frame: pd.DataFrame, group_size: int | None) -> list[str]:
    """Rows of the blocks of group_size consecutive rows that are not one whole group (one prompt_id, indices 0..group_size-1)."""
    if group_size is None:
        return []
    if group_size <= 0:
        raise ValueError(f"group_size must be > 0, got {group_size}")
    position = np.arange(len(frame))
    prompt_ids, first = frame["prompt_id"].to_numpy(), position - position % group_size
    in_place = (frame["index"].to_numpy() == position % group_size) & (prompt_ids == prompt_ids[first])
    whole = np.ones(-(-len(frame) // group_size), dtype=bool)
    np.logical_and.at(whole, position // group_size, in_place)
    if len(frame) % group_size:
        whole[-1] = False  # a block cut short
    rows = frame.index[~whole[position // group_size]].tolist()
    return [f"columns prompt_id, index: check 'whole_groups_of({group_size})' failed at {_at(frame, rows)}"] if rows else []


def _describe(err: SchemaErrors, frame: pd.DataFrame) -> str:
    lines = []
    for check, group in err.failure_cases.groupby("check", dropna=False, sort=False):
        columns = group["column"].dropna().unique().tolist()
        rows = sorted({int(i) for i in group["index"].dropna()})
        if str(check) in ROW_CHECK_COLUMNS:
            columns = list(ROW_CHECK_COLUMNS[str(check)])
        what = f"column {columns[0]}" if len(columns) == 1 else f"columns {', '.join(columns)}" if columns else "row"
        where = _at(frame, rows) if rows else f"{[str(c)[:60] for c in group['failure_case'].tolist()[:5]]}"
        # for these pandera names the schema as the column: say what is missing or unexpected instead
        what = {"column_in_dataframe": "missing columns", "column_in_schema": "unexpected columns"}.get(str(check), what)
        lines.append(f"{what}: check {str(check)[:80]!r} failed at {where}")
    more = f"; and {len(lines) - 3} more failed checks" if len(lines) > 3 else ""
    return "; ".join(lines[:3]) + more
