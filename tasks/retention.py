"""The checkpoints a run prunes (cluster.keep_checkpoints; the loop decides which: workflows/nodes.py `kept`), and
the check of the tasks that read one."""

from __future__ import annotations

from flytekit import task
from flytekit.core.context_manager import FlyteContextManager

from containers.images import cpu_image
from miles_core.retention import check_kept, prune
from tasks.common import Checkpoint, uri_of
from tasks.metadata import SMALL, declared
from tasks.retry import recoverable


def _fs(uri: str):
    return FlyteContextManager.current_context().file_access.get_filesystem_for_path(uri)


@task(container_image=cpu_image, **declared("prune", SMALL, minutes=30))
@recoverable
def prune_checkpoint(ckpt: Checkpoint, newer: Checkpoint, iterations_done: int, keep: int, every: int) -> None:
    """Delete `ckpt` (written after `iterations_done` iterations) but its tombstone, now that `newer` exists: the
    newest `keep` checkpoints go on, and of the older ones those after a multiple of `every` iterations."""
    uri = uri_of(ckpt.dir)
    record = {"iterations_done": iterations_done, "keep_checkpoints": keep, "keep_checkpoints_every": every, "newer": uri_of(newer.dir)}
    deleted = prune(_fs(uri), uri, record)
    print(f"checkpoint after {iterations_done} iterations pruned ({deleted} entries): {uri}", flush=True)


def kept_uri(ckpt: Checkpoint) -> str:
    """Where the checkpoint `ckpt` lives, checked not pruned (miles_core.retention.PrunedCheckpoint names it if it is)."""
    uri = uri_of(ckpt.dir)
    return check_kept(_fs(uri), uri)
