"""Pruning a checkpoint a run no longer keeps (cluster.keep_checkpoints), on any fsspec filesystem: the object store
of a cluster, a local disk.

A pruned checkpoint's folder keeps one file, its tombstone (TOMBSTONE): what pruned it and when. The folder still
exists, so every cache entry that names it stays valid (a run resumes after it; a local run's cache check passes), and
a task that would read it (a replay from an iteration whose checkpoint is gone) stops with an error that says why,
instead of on files that are missing.
"""

from __future__ import annotations

import json
import posixpath
import time

import fsspec

TOMBSTONE = "PRUNED.json"


class PrunedCheckpoint(ValueError):
    """A task was handed a checkpoint the run has pruned."""


def prune(fs: fsspec.AbstractFileSystem, uri: str, record: dict) -> int:
    """Everything under `uri` but its tombstone deleted, the tombstone (`record`, with the time) written first; returns
    how many entries were deleted. Pruning a pruned folder deletes nothing."""
    fs.makedirs(uri, exist_ok=True)
    fs.pipe_file(posixpath.join(uri, TOMBSTONE), json.dumps(record | {"pruned_at": time.time()}, sort_keys=True).encode())
    doomed = [path for path in fs.ls(uri, detail=False) if posixpath.basename(path.rstrip("/")) != TOMBSTONE]
    if doomed:
        fs.rm(doomed, recursive=True)
    return len(doomed)


def check_kept(fs: fsspec.AbstractFileSystem, uri: str) -> str:
    """`uri`, where its folder is not pruned; else PrunedCheckpoint naming it, what pruned it and what is kept."""
    tombstone = posixpath.join(uri, TOMBSTONE)
    if not fs.exists(tombstone):
        return uri
    record = json.loads(fs.cat_file(tombstone))
    keep, every = record.get("keep_checkpoints"), record.get("keep_checkpoints_every")
    kept = f"the newest {keep}" + (f" and those after a multiple of {every} iterations" if every else "")
    raise PrunedCheckpoint(
        f"checkpoint {uri}: pruned after {record.get('iterations_done')} iterations by cluster.keep_checkpoints={keep}, "
        f"keep_checkpoints_every={every} (the run keeps {kept}); resume or replay from a kept one"
    )
