"""Where artifacts live under the run root, and how they are written without loss.

Every artifact (checkpoint, rollout batch, published policy) gets a path derived from the stage,
the iteration and a digest of what produced it, so a re-run with the same inputs writes to the
same place and a run with other inputs never overwrites it.  Writes go to a temporary sibling
first and are renamed into place, so a killed task leaves no half-written artifact behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
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
