"""Typed values that flow between the tasks, and what every task shares (cache version, artifacts).

An artifact another task reads is written to a scratch folder on the task's own disk and returned as
an upload (`uploaded_dir`, `uploaded_file`) to a place under the run root named by its stage and the
digest of what produced it (`artifact_uri`): an object-store URI on a cluster, a local folder in a local
run. flytekit uploads it when the task returns; the consumer downloads it (`.download()`) and names it
by its URI (`uri_of`), never by the path it was downloaded to. A cache hit returns the uploaded copy.

The async phase's actors run on other pods than its task: they fetch and store through `OBJECT_STORE`
(the same file access flytekit uses, configured from the pod's environment), and the task returns
what the trainer actor stored as `stored_dir`.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import flytekit
from flytekit.core.context_manager import FlyteContextManager
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

import miles_core
from miles_core.config import config_hash
from miles_core.data.source import DataState
from miles_core.plugins import code_closure
from miles_core.storage import Transfer, artifact_name, copy_into, digest
from tasks import decks, local_cache

local_cache.check_hits()  # a local run's cache hit whose artifacts were deleted runs the task again
decks.source_rendered_once()  # a task's source code deck highlighted once per process


@dataclass
class Policy:
    """A published policy version: an HF safetensors directory, or with train.lora a LoRA adapter for the base model `base`."""

    dir: FlyteDirectory
    version: int
    base: Optional[FlyteDirectory] = None  # noqa: UP045 (flytekit's type engine) the HF base model an adapter applies to


@dataclass
class Checkpoint:
    """A trainer checkpoint (model, optimizer, RNG, step) in the backend's own format."""

    dir: FlyteDirectory
    step: int


@dataclass
class Dataset:
    """Train and held-out prompt files, with the sha256 of the train file (the data hash)."""

    train: FlyteFile
    test: FlyteFile
    sha256: str


@dataclass
class RolloutResult:
    batch: FlyteFile
    state: DataState  # the data source's position after this batch
    metrics: dict[str, float]
    buffer: Optional[FlyteFile] = None  # noqa: UP045 (flytekit's type engine) groups generated beyond the batch, for the next step


@dataclass
class BatchResult:
    batch: FlyteFile
    metrics: dict[str, float]


@dataclass
class TrainResult:
    ckpt: Checkpoint
    metrics: dict[str, float]
    dump: Optional[FlyteDirectory] = None  # noqa: UP045 (flytekit's type engine) the batch as a readable dataset (debug.dump_rollouts)


@dataclass
class Tracking:
    uri: str
    run_id: str


def new_artifact(root: str, stage: str, iteration: int, *inputs: object, suffix: str = "") -> tuple[Path, str]:
    """Where this task writes an artifact on its own disk (in its execution's working directory, the same for every
    process of an Elastic task), and where it is uploaded to: <root>/<stage>/<iteration:04d>-<digest of inputs><suffix>
    under the run root (`run_root_of`)."""
    name = artifact_name(stage, iteration, *inputs, suffix=suffix)
    return Path(flytekit.current_context().working_directory) / "artifacts" / name, f"{run_root_of(root).rstrip('/')}/{name}"


def run_root_of(root: str) -> str:
    """Where a task's artifacts go: the recipe's run root when it is an object-store URI or the run is local; on a
    cluster, where a local folder would be the pod's own disk (gone with the pod), the execution's raw-output prefix."""
    if "://" in root or FlyteContextManager.current_context().execution_state.is_local_execution():
        return root
    return flytekit.current_context().raw_output_prefix


def member(directory: FlyteDirectory, name: str) -> Path:
    """One file of an input directory, downloaded alone (a manifest, a source record) instead of the whole directory."""
    if not directory.remote_source:
        return Path(directory.path) / name
    local = Path(tempfile.mkdtemp(dir=flytekit.current_context().working_directory)) / name
    FlyteContextManager.current_context().file_access.get_data(f"{directory.remote_source.rstrip('/')}/{name}", str(local))
    return local


def uploaded_dir(local: str | os.PathLike, dest: str) -> FlyteDirectory:
    """The folder `local`, which flytekit uploads to `dest` when the task returns."""
    return FlyteDirectory(str(local), remote_directory=dest)


def uploaded_file(local: str | os.PathLike, dest: str) -> FlyteFile:
    """The file `local`, which flytekit uploads to `dest` when the task returns."""
    return FlyteFile(str(local), remote_path=dest)


def stored_dir(uri: str) -> FlyteDirectory:
    """A directory another process already put at `uri` (the async phase's trainer actor): returned as it is."""
    return FlyteDirectory.from_source(uri)


def fetched(uri: str, directory: bool = True) -> str:
    """The directory (or file) at `uri` on this process's disk, downloaded into a fresh temporary folder of its own (a
    local path: itself). Every process of a multi-process task fetches its inputs so: flytekit's `.download()` puts an
    input at one path per URI, where one process would read a file another is still writing."""
    files = FlyteContextManager.current_context().file_access
    if not files.is_remote(uri):
        return uri
    local = tempfile.mkdtemp(prefix="fetched-")
    if not directory:
        local = os.path.join(local, os.path.basename(uri.rstrip("/")))
    files.get_data(uri, local, is_multipart=directory)
    return local


def stored(local: str, uri: str) -> None:
    """The directory `local` uploaded to `uri` (a local path: copied there)."""
    files = FlyteContextManager.current_context().file_access
    if files.is_remote(uri):
        files.put_data(local, uri, is_multipart=True)
    else:
        copy_into(local, uri)


OBJECT_STORE = Transfer(fetch=fetched, store=stored)


def base_dir_of(policy: Policy) -> str | None:
    """The base model of a LoRA policy on this pod's disk (None: the policy holds full weights)."""
    return policy.base.download() if policy.base is not None else None


def uri_of(artifact: FlyteDirectory | FlyteFile) -> str:
    """Where an input artifact lives (its object-store URI; in a local run its path): what names and digests refer to."""
    return artifact.remote_source or str(artifact.path)


def cache_version(*sections: type, module: str) -> str:
    """Derived from the schema and defaults of the config sections a task reads, the core's version
    and the source of the task's module with every miles_core/tasks module it imports (transitively):
    changing any of them invalidates that task's cache. The section values are inputs, and so is the
    digest of the recipe's own plug-in modules (`code`, from `miles_core.plugins.plugin_code`)."""
    schema = [(s.__name__, [(f.name, str(f.type)) for f in fields(s)], config_hash(s())) for s in sections]
    return f"{miles_core.__version__}-{digest(schema)}-{code_closure(module)}"


@dataclass
class AsyncPhaseResult:
    """What an async phase of K training steps leaves for the next phase or sync iteration."""

    ckpt: Checkpoint  # the trainer's checkpoint after the phase, in the backend's format
    policy: Policy  # the same weights published as version start + K
    batches: FlyteDirectory  # step-NNNN.parquet: every consumed batch, scored, with weight and trainer versions
    buffer: Optional[FlyteFile]  # noqa: UP045 (flytekit's type engine) scored groups generated but not consumed, with their weight versions
    state: DataState  # the data source's position after every prompt this phase drew
    dropped: list[str]  # "draw/index" of the samples dropped as too stale
    steps: list[dict[str, float]]  # per training step: the training metrics and the async ones
    metrics: dict[str, float]  # the phase's totals: throughput, staleness distribution, idle times
