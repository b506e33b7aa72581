"""What a run prunes (cluster.keep_checkpoints; the loop decides which: workflows/nodes.py `kept`), and the check of the
tasks that read a checkpoint or a policy."""

from __future__ import annotations

from typing import Optional

from flytekit import task
from flytekit.core.context_manager import FlyteContextManager
from flytekit.types.directory import FlyteDirectory

from containers.images import cpu_image
from miles_core.retention import check_kept, prune
from miles_core.weights.manifest import MANIFEST_FILE
from tasks.common import Checkpoint, Policy, uri_of
from tasks.metadata import SMALL, declared
from tasks.retry import recoverable


def _fs(uri: str):
    return FlyteContextManager.current_context().file_access.get_filesystem_for_path(uri)


@task(container_image=cpu_image, **declared("prune", SMALL, minutes=30))
@recoverable
def prune_iteration(ckpt: Checkpoint, policy: Optional[Policy], newer: Checkpoint, iterations_done: int, keep: int, every: int) -> None:  # noqa: UP045 (the Optional flytekit's type engine reads)
    """Delete the checkpoint `ckpt` written after `iterations_done` iterations, and the policy published from it where
    one is given (its manifest stays), now that `newer` exists: the newest `keep` go on, and of the older ones those
    after a multiple of `every` iterations."""
    record = {"iterations_done": iterations_done, "keep_checkpoints": keep, "keep_checkpoints_every": every, "newer": uri_of(newer.dir)}
    pruned = [("checkpoint", uri_of(ckpt.dir), ())] + ([("policy", uri_of(policy.dir), (MANIFEST_FILE,))] if policy is not None else [])
    for kind, uri, keeping in pruned:
        deleted = prune(_fs(uri), uri, record | {"kind": kind}, keeping)
        print(f"{kind} after {iterations_done} iterations pruned ({deleted} entries): {uri}", flush=True)


def unpruned(directory: FlyteDirectory) -> FlyteDirectory:
    """A checkpoint's or a policy's folder, checked not pruned (miles_core.retention.Pruned names it if it is): what a
    task reads first, so that a replay from an iteration the run pruned stops saying so."""
    uri = uri_of(directory)
    check_kept(_fs(uri), uri)
    return directory
