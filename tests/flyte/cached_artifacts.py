"""A workflow of one cached task that publishes a Policy (a directory uploaded under the run root, inside a dataclass)
and one uncached task that reads it: what a local cache hit hands on. Each run of the cached task appends a line to
$RUNS_LOG."""

import os
from pathlib import Path

import flytekit

from tasks.common import Policy, uploaded_dir


@flytekit.task(cache=True, cache_version="1")
def publish(root: str, text: str) -> Policy:
    with open(os.environ["RUNS_LOG"], "a", encoding="utf-8") as log:
        log.write("publish\n")
    local = Path(flytekit.current_context().working_directory) / "policy"
    local.mkdir()
    (local / "weights.txt").write_text(text)
    return Policy(dir=uploaded_dir(local, f"{root}/policy"), version=1)


@flytekit.task
def read(policy: Policy) -> str:
    return (Path(policy.dir.download()) / "weights.txt").read_text()


@flytekit.workflow
def wf(root: str, text: str) -> str:
    return read(policy=publish(root=root, text=text))
