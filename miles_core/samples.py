"""Samples and rollout batches.

A `Sample` is one response to one prompt, token in and token out: the prompt's token ids, the
response's token ids as generated (never re-tokenised), one rollout log-prob and one loss-mask
entry per response token, how generation ended and the weight version that produced it.
A rollout batch is a list of samples, `group_size` consecutive samples per prompt; on disk it is
a parquet file whose schema `miles_core.schemas` checks at every task boundary.  With routing replay (R3) a sample
also carries the experts its tokens were routed to in rollout (layout in miles_core/routing.py), as int16 on disk. With
on-policy distillation the teacher's task adds the teacher's log-prob of each response token (miles_core/distill.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

import numpy as np
import pandas as pd
import pyarrow


@dataclass
class Sample:
    prompt_id: str  # stable id of the prompt in its source
    index: int  # position within its group, 0..n-1
    prompt_tokens: list[int]
    response_tokens: list[int]
    rollout_logprobs: list[float]  # [T] log-prob of each response token under the rollout policy
    loss_mask: list[int]  # [T] 1 = the policy's own token, trained on
    finish_reason: str  # stop | length | abort
    weight_version: int  # policy version that generated the response
    label: str  # reference answer, as the data source gave it
    metadata: dict = field(default_factory=dict)
    reward: float = float("nan")  # filled by scoring
    routed_experts: list[int] = field(default_factory=list)  # R3: [position, MoE layer, k] flattened, or empty
    teacher_logprobs: list[float] = field(default_factory=list)  # [T] the distillation teacher's log-prob of each response token, or empty

    @property
    def sample_id(self) -> str:
        return sample_id_of(self.prompt_id, self.index)


def sample_id_of(prompt_id: str, index: int) -> str:
    """A sample's id: its group (the prompt's id) and its position in the group."""
    return f"{prompt_id}/{index}"


COLUMNS = [f.name for f in fields(Sample)]


def to_frame(samples: list[Sample]) -> pd.DataFrame:
    columns = {"sample_id": [s.sample_id for s in samples]} | {name: [getattr(s, name) for s in samples] for name in COLUMNS}
    columns["metadata"] = [json.dumps(metadata, sort_keys=True) for metadata in columns["metadata"]]
    columns["routed_experts"] = [np.asarray(experts, dtype=np.int16) for experts in columns["routed_experts"]]  # ids < 32768: every published MoE
    return pd.DataFrame(columns)


def from_frame(frame: pd.DataFrame) -> list[Sample]:
    """The samples of a checked batch, each value of the Python type its field declares."""
    return from_table(pyarrow.Table.from_pandas(frame, preserve_index=False))


def from_table(table: pyarrow.Table) -> list[Sample]:
    """The samples of a checked batch as arrow holds it (a parquet file read), each value of the Python type its field
    declares. Each column comes out as Python objects at once (`to_pylist`), not as an array per row turned into a list."""
    columns = [_python_values(table.column(name), _CONVERTERS[name]) for name in COLUMNS]
    return [Sample(*values) for values in zip(*columns)]


def _python_values(column: pyarrow.ChunkedArray, convert) -> list:
    values = column.to_pylist()
    native = _NATIVE.get(convert)
    if native is not None and pyarrow.types.is_list(column.type) and native(column.type.value_type):
        return values  # lists of Python ints (floats) already
    return [convert(value) for value in values]


def _ints(values) -> list[int]:
    return [int(v) for v in values]


def _floats(values) -> list[float]:
    return [float(v) for v in values]


def _reward(value) -> float:
    return math.nan if value is None else float(value)  # a missing reward (an unscored sample) is NaN, as in a Sample


_NATIVE = {_ints: pyarrow.types.is_integer, _floats: pyarrow.types.is_floating}  # list columns arrow gives as they are
_CONVERTERS = {
    "prompt_id": str,
    "index": int,
    "prompt_tokens": _ints,
    "response_tokens": _ints,
    "rollout_logprobs": _floats,
    "loss_mask": _ints,
    "finish_reason": str,
    "weight_version": int,
    "label": str,
    "metadata": json.loads,
    "reward": _reward,
    "routed_experts": _ints,
    "teacher_logprobs": _floats,
}
