"""Where artifacts live under the run root, and how they are written without loss.

Every artifact (checkpoint, rollout batch, published policy) gets a path derived from the stage,
the iteration and a digest of what produced it, so a re-run with the same inputs writes to the
same place and a run with other inputs never overwrites it.  Writes go to a temporary sibling
first and are renamed into place, so a killed task leaves no half-written artifact behind.
A `Transfer` says how a process that runs away from its task (a Ray actor on another pod) reaches the
artifacts a URI names.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def digest(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:10]


def artifact_name(stage: str, iteration: int, *inputs: object, suffix: str = "") -> str:
    """<stage>/<iteration:04d>-<digest of inputs><suffix>: an artifact's place under any run root (a folder or a URI)."""
    return f"{stage}/{iteration:04d}-{digest(stage, iteration, *inputs)}{suffix}"


def artifact_path(root: str, stage: str, iteration: int, *inputs: object, suffix: str = "") -> Path:
    """<root>/<stage>/<iteration:04d>-<digest of inputs><suffix>"""
    return Path(root) / artifact_name(stage, iteration, *inputs, suffix=suffix)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike):
    """Yield a fresh temporary directory that replaces `path` once the block succeeds."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)  # parents too: the first artifact of a stage creates its folder
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():  # a directory cannot be replaced in one rename: move it aside until the new one is in
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def user_cache() -> Path:
    """The user's cache folder ($XDG_CACHE_HOME, else ~/.cache; the Makefile's environments live there too): what a machine
    keeps between runs. A run given a fresh HOME (a private Flyte cache) is still given this one."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a temporary file path that replaces `path` once the block succeeds."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, final)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def on_disk(path: str) -> str:
    """A directory of this machine's disk, where it is."""
    return path


def copy_into(local: str, dest: str) -> None:
    """A directory copied whole to `dest` on this disk (replacing what was there)."""
    with atomic_dir(dest) as tmp:
        shutil.copytree(local, tmp, dirs_exist_ok=True)


@dataclass(frozen=True)
class Transfer:
    """How a process reaches artifacts named by a URI: `fetch(uri)` gives a local directory holding it, `store(local,
    uri)` puts a local directory there. The default is this disk (paths as URIs); a task passes its object store's
    (tasks/common.py `OBJECT_STORE`), so the async phase's actors read and write where the task would, from any pod."""

    fetch: Callable[[str], str] = on_disk
    store: Callable[[str, str], None] = copy_into
