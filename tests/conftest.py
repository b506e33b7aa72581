"""Real local workflow runs through `pyflyte run`, each with its own Flyte cache (HOME) and run root."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis.configuration import set_hypothesis_home_dir

from miles_core.storage import user_cache

REPO = Path(__file__).resolve().parents[1]
# hypothesis keeps its examples outside the source tree: an image's tag hashes the tree's files (flytekit's ImageSpec,
# tests/flyte), and a temporary file hypothesis wrote and removed meanwhile under ./.hypothesis failed that hash
set_hypothesis_home_dir(user_cache() / "miles-flyte" / "hypothesis")
PYFLYTE = Path(sys.executable).parent / "pyflyte"
# The files that take half a minute or more (pytest --durations), longest first. `make test` hands whole files to two
# workers in collection order (xdist --dist loadfile --no-loadscope-reorder; by default xdist orders files by their
# number of tests instead): started first, they run beside the short files instead of after them.
LONGEST_FIRST = (
    "tests/flyte/test_learning.py",
    "tests/integration/test_async_phase.py",
    "tests/pods/test_rl_pods.py",
    "tests/integration/test_sglang.py",
    "tests/pods/test_async_pods.py",
    "tests/flyte/test_run.py",
    "tests/pods/test_convert_pods.py",
    "tests/integration/test_distill_learning.py",
    "tests/flyte/test_async_run.py",
    "tests/flyte/test_megatron_run.py",
    "tests/flyte/test_replay.py",
    "tests/integration/test_sglang_families.py",
    "tests/integration/test_sglang_lora.py",
    "tests/flyte/test_cache_code.py",
    "tests/integration/test_lora_learning.py",
    "tests/flyte/test_distill.py",
    "tests/unit/test_checkpoint_megatron.py",
    "tests/flyte/test_launch_plans.py",
    "tests/integration/test_step_parity.py",
    "tests/integration/test_sglang_speculative.py",
    "tests/unit/test_start_up.py",
    "tests/flyte/test_multi_turn_workflow.py",
    "tests/unit/test_int4.py",
    "tests/unit/test_quantize.py",
    "tests/flyte/test_debug_modes.py",
    "tests/flyte/test_recipe_file.py",
    "tests/flyte/test_memory.py",
    "tests/integration/test_sglang_env.py",
    "tests/integration/test_megatron_parallel.py",
    "tests/flyte/test_families.py",
)


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


def workflow_command(recipe: str, root: Path, *overrides: str, workflow: tuple[str, str] = ("workflows/rl.py", "rl")) -> list[str]:
    cfg = subprocess.run(
        [sys.executable, "-m", "miles_core.config", recipe, f"run_root={root}", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [str(PYFLYTE), "run", *workflow, "--cfg", cfg]


def workflow_env(home: Path) -> dict:
    home.mkdir(parents=True, exist_ok=True)
    # COLUMNS: flytekit prints errors through rich, which breaks a long word (a deep temporary path) at the terminal width
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(user_cache())}  # a private Flyte cache; the machine's own caches
    return {**os.environ, **env, "FLYTE_SDK_LOGGING_LEVEL": "20", "TRANSFORMERS_VERBOSITY": "error", "COLUMNS": "1000"}


def extends(target: Path, recipe: Path) -> str:
    """`extends:` for a recipe written at `recipe` that extends `target` (recipes take relative paths only)."""
    return os.path.relpath(target, recipe.parent)


def run_workflow(recipe: str, root: Path, home: Path, *overrides: str, workflow: tuple[str, str] = ("workflows/rl.py", "rl")) -> subprocess.CompletedProcess:
    out = subprocess.run(
        workflow_command(recipe, root, *overrides, workflow=workflow), cwd=REPO, env=workflow_env(home), capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def deck_files(log: str) -> list[tuple[str, str]]:
    """(task name, its deck's HTML file) of each task run, in order, from the INFO lines of a local run (rich wraps them
    anywhere: read without spaces)."""
    return re.findall(r"-(\w+?)taskcreatesflytedeckhtmltofile://(\S+?deck\.html)", "".join(log.split()))


def decks(log: str) -> dict[str, str]:
    """{task name: its last deck's HTML} of a local run's log."""
    return {task: open(path, encoding="utf-8").read() for task, path in deck_files(log)}


def final_policy(root: Path) -> Path:
    """The published policy with the highest version under a run root."""
    manifests = [json.loads(p.read_text()) | {"dir": p.parent} for p in root.glob("policy/*/policy.json")]
    return max(manifests, key=lambda m: m["version"])["dir"]


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """One uninterrupted run of the smoke recipe (3 iterations), shared by the tests that read it: run once per pytest
    invocation, by the first test process that needs it, in the directory the xdist workers share (the others wait)."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared  # the workers' base dirs are siblings
    base = shared / "smoke"
    with FileLock(shared / "smoke.lock"):
        if not (base / "out.json").exists():
            out = run_workflow("recipes/smoke.yaml", base / "runs", base / "home", "iterations=3")
            (base / "out.json").write_text(json.dumps({"args": out.args, "stdout": out.stdout, "stderr": out.stderr}))
    out = json.loads((base / "out.json").read_text())
    return base / "runs", subprocess.CompletedProcess(out["args"], 0, out["stdout"], out["stderr"])
