"""The conversion workflow: a user's HF checkpoint -> the trainer backend's format -> HF again.

    pyflyte run workflows/convert.py convert --cfg "$(python -m miles_core.config recipes/tiny_arith_megatron.yaml model.path=s3://...)"

The same cached tasks the RL workflow runs before its first step (base_model, admit_model, convert)
and after each (publish), so a conversion made here is a cache hit for a later RL run of the same
config. The result's `exported` is an HF directory a user loads with `from_pretrained`: the round trip
of the weights through the backend's format, a check of the conversion before any GPU time is spent.
"""

from __future__ import annotations

from typing import NamedTuple

from flytekit import workflow

from miles_core.config import RunConfig
from tasks.common import Checkpoint, Policy
from tasks.prepare import admit_model, base_model
from tasks.rl import convert as to_backend
from tasks.rl import publish


class Converted(NamedTuple):
    checkpoint: Checkpoint  # the backend's format (megatron: torch_dist, reshardable to any parallel sizes)
    exported: Policy  # the checkpoint back in HF format, version 1 of the base


@workflow
def convert(cfg: RunConfig = RunConfig()) -> Converted:  # noqa: B008 (the workflow's default input, frozen)
    base = admit_model(base=base_model(cfg=cfg.model, root=cfg.run_root), train=cfg.train, rollout=cfg.rollout)
    checkpoint = to_backend(cfg=cfg.train, algo=cfg.algo, policy=base, root=cfg.run_root)
    return checkpoint, publish(cfg=cfg.publish, train_cfg=cfg.train, ckpt=checkpoint, parent=base, root=cfg.run_root)
