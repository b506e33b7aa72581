"""Pruning what a run no longer keeps (cluster.keep_checkpoints: a trainer checkpoint, and with keep_policies false the
policy published from it), on any fsspec filesystem: the object store of a cluster, a local disk.

A pruned folder keeps its tombstone (TOMBSTONE: what pruned it and when), and a policy its lineage manifest. The folder
still exists, so every cache entry that names it stays valid (a run resumes after it; a local run's cache check
passes; the tracking of a resumed run reads the policy's manifest), and a task that would read it (a replay from an
iteration whose checkpoint is gone) stops with an error that says why, instead of on files that are missing.
"""

from __future__ import annotations

import json
import posixpath
import time

import fsspec

TOMBSTONE = "PRUNED.json"


class Pruned(ValueError):
    """A task was handed a checkpoint or a policy the run has pruned."""


def prune(fs: fsspec.AbstractFileSystem, uri: str, record: dict, keeping: tuple[str, ...] = ()) -> int:
    """Everything under `uri` deleted but its tombstone (`record`, with the time, written first) and the files named in
    `keeping`; returns how many entries were deleted. Pruning a pruned folder deletes nothing."""
    fs.makedirs(uri, exist_ok=True)
    fs.pipe_file(posixpath.join(uri, TOMBSTONE), json.dumps(record | {"pruned_at": time.time()}, sort_keys=True).encode())
    doomed = [path for path in fs.ls(uri, detail=False) if posixpath.basename(path.rstrip("/")) not in (TOMBSTONE, *keeping)]
    if doomed:
        fs.rm(doomed, recursive=True)
    return len(doomed)


def check_kept(fs: fsspec.AbstractFileSystem, uri: str) -> str:
    """`uri`, where its folder is not pruned; else Pruned naming it, what pruned it and what the run keeps."""
    tombstone = posixpath.join(uri, TOMBSTONE)
    if not fs.exists(tombstone):
        return uri
    try:
        record = json.loads(fs.cat_file(tombstone))
    except ValueError:  # not JSON: still a pruned folder, for whatever reason
        record = None
    record = record if isinstance(record, dict) else {}
    keep, every = record.get("keep_checkpoints"), record.get("keep_checkpoints_every")
    kept = f"the newest {keep}" + (f" and those after a multiple of {every} iterations" if every else "")
    raise Pruned(
        f"{record.get('kind', 'folder')} {uri}: pruned after {record.get('iterations_done')} iterations by "
        f"cluster.keep_checkpoints={keep}, keep_checkpoints_every={every} (the run keeps {kept}); resume or replay from a kept one"
    )
