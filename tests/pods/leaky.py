"""Tiny workflows the pod tier runs to prove what a pod sees: one hands the next a path on its own disk (which
a cluster's next pod cannot read, so the tier must fail it), one reports its pod's surroundings."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from flytekit import task, workflow
from flytekit.types.file import FlyteFile


@task
def write_locally() -> str:
    """Writes a file on its pod's disk and passes on its path instead of the file: the mistake the tier catches."""
    path = Path(tempfile.mkdtemp()) / "result.txt"
    path.write_text("42")
    return str(path)


@task
def read_path(path: str) -> str:
    return Path(path).read_text()


@workflow
def leaky() -> str:
    return read_path(path=write_locally())


@task
def write_uploaded() -> FlyteFile:
    """The same file returned as a FlyteFile: flytekit uploads it and the next pod downloads it."""
    path = Path(tempfile.mkdtemp()) / "result.txt"
    path.write_text("42")
    return FlyteFile(str(path))


@task
def read_file(file: FlyteFile) -> str:
    return Path(file.download()).read_text()


@workflow
def uploaded() -> str:
    return read_file(file=write_uploaded())


@task
def surroundings(probe: str) -> dict[str, str]:
    """What the pod sees: its working directory's contents, HOME, TMPDIR, where the project's code comes from, and
    whether a path of the submitter's disk (`probe`) is there."""
    import tasks

    return {
        "probe_exists": str(os.path.exists(probe)),
        "cwd": os.getcwd(),
        "cwd_entries": ",".join(sorted(os.listdir("."))),
        "home": os.environ["HOME"],
        "tmpdir": tempfile.gettempdir(),
        "code": tasks.__path__[0],
        "python": sys.executable,
    }


@workflow
def pod_view(probe: str) -> dict[str, str]:
    return surroundings(probe=probe)
