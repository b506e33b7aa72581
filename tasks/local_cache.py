"""A local run's cache hit whose artifacts are gone is a miss.

flytekit's local cache (~/.flyte/local-cache, one per user, shared by every clone and run root) keeps a task's
outputs, and of an artifact only its URI. Once that artifact is deleted (runs/ removed by hand, a new clone at the
path of a deleted one), a hit would hand the next task a path to nothing, and the run would stop there ("Field "dir"
of type FlyteDirectory in Policy has invalid value"). `check_hits` makes every hit look first: when an artifact its
outputs name no longer exists, the hit is a miss, with a warning naming the task and the artifact; the task runs
again and its outputs replace the entry. On a cluster, hits come from Flyte's catalog, not from here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import msgpack
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.local_cache import LocalTaskCache
from flytekit.models.literals import Literal, LiteralMap

_lookup = LocalTaskCache.get


def artifact_uris(literal: Literal) -> Iterator[str]:
    """The URI of every file and directory a task output holds, at any depth (lists, dicts, dataclass fields)."""
    if literal.scalar is not None and literal.scalar.blob is not None:
        yield literal.scalar.blob.uri
    elif literal.scalar is not None and literal.scalar.binary is not None and literal.scalar.binary.tag == "msgpack":
        yield from _paths(msgpack.unpackb(literal.scalar.binary.value))  # a dataclass or dict: flytekit's msgpack form
    elif literal.collection is not None:
        for item in literal.collection.literals:
            yield from artifact_uris(item)
    elif literal.map is not None:
        for item in literal.map.literals.values():
            yield from artifact_uris(item)


def _paths(value: object) -> Iterator[str]:
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        yield value["path"]  # a FlyteFile or FlyteDirectory serialised inside a dataclass
    elif isinstance(value, (dict, list)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _paths(item)


def missing_artifact(outputs: LiteralMap) -> str | None:
    """The first artifact a task's outputs name that no longer exists (None: all are there)."""
    files = FlyteContextManager.current_context().file_access
    return next((uri for literal in outputs.literals.values() for uri in artifact_uris(literal) if not files.exists(uri)), None)


def _present_hit(task_name: str, cache_version: str, inputs: LiteralMap, ignored: tuple[str, ...]) -> LiteralMap | None:
    outputs = _lookup(task_name, cache_version, inputs, ignored)
    gone = outputs and missing_artifact(outputs)
    if gone:
        logging.getLogger("miles_flyte").warning("%s: its cached outputs name %s, which no longer exists: the task runs again", task_name, gone)
        return None
    return outputs


def check_hits() -> None:
    """Every local cache hit from now on is served only when the artifacts it names still exist."""
    LocalTaskCache.get = staticmethod(_present_hit)
