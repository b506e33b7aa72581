"""A local run's cache hit whose artifacts were deleted runs the task again (tasks/local_cache.py).

Real `pyflyte run`s of tests/flyte/cached_artifacts.py with one private Flyte cache (HOME): the cached task's
outputs name a directory under the run root, which the test deletes between runs."""

import shutil
import subprocess
from pathlib import Path

import pytest
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.type_engine import TypeEngine
from flytekit.models.literals import LiteralMap
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from tasks.common import Checkpoint, Policy, TrainResult
from tasks.local_cache import artifact_uris, missing_artifact
from tests.conftest import PYFLYTE, REPO, workflow_env

pytestmark = pytest.mark.flyte


def literal(value, python_type):
    ctx = FlyteContextManager.current_context()
    return TypeEngine.to_literal(ctx, value, python_type, TypeEngine.to_literal_type(python_type))


def test_the_uris_of_a_tasks_outputs_are_found_at_any_depth(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    for name in ("f.txt", "g.txt"):
        (tmp_path / name).write_text("x")
    policy = Policy(dir=FlyteDirectory.from_source(str(tmp_path / "a")), version=3, base=FlyteDirectory.from_source(str(tmp_path / "b")))
    assert sorted(artifact_uris(literal(policy, Policy))) == [str(tmp_path / "a"), str(tmp_path / "b")]
    result = TrainResult(ckpt=Checkpoint(dir=FlyteDirectory.from_source(str(tmp_path / "c")), step=1), metrics={"loss": 0.5, "path": 1.0})
    assert list(artifact_uris(literal(result, TrainResult))) == [str(tmp_path / "c")]
    files = [FlyteFile.from_source(str(tmp_path / "f.txt")), FlyteFile.from_source(str(tmp_path / "g.txt"))]
    assert [Path(uri).name for uri in artifact_uris(literal(files, list[FlyteFile]))] == ["f.txt", "g.txt"]  # uploaded copies
    assert list(artifact_uris(literal({"x": 1.0}, dict[str, float]))) == [] and list(artifact_uris(literal(7, int))) == []


def test_a_missing_artifact_is_named(tmp_path):
    def outputs(name: str) -> LiteralMap:
        (tmp_path / name).mkdir()
        return LiteralMap({"o0": literal(Policy(dir=FlyteDirectory.from_source(str(tmp_path / name)), version=1), Policy)})

    kept, gone = outputs("kept"), outputs("gone")
    (tmp_path / "gone").rmdir()
    assert missing_artifact(kept) is None
    assert missing_artifact(gone) == str(tmp_path / "gone")


def test_a_hit_whose_artifact_was_deleted_runs_the_task_again(tmp_path):
    root, runs_log = tmp_path / "runs", tmp_path / "runs.log"
    env = workflow_env(tmp_path / "home") | {"RUNS_LOG": str(runs_log)}

    def run() -> subprocess.CompletedProcess:
        command = [str(PYFLYTE), "run", "tests/flyte/cached_artifacts.py", "wf", "--root", str(root), "--text", "weights"]
        out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        return out

    run()
    run()  # a hit: the artifact is there
    assert runs_log.read_text().splitlines() == ["publish"]
    shutil.rmtree(root)
    out = run()  # the entry names a deleted directory: the task runs again and publishes it again
    assert runs_log.read_text().splitlines() == ["publish", "publish"]
    assert f"publish: its cached outputs name {root}/policy, which no longer exists" in "".join((out.stdout + out.stderr).split("\n"))
    assert (root / "policy" / "weights.txt").read_text() == "weights"
    run()  # the new entry is served again
    assert runs_log.read_text().splitlines() == ["publish", "publish"]
