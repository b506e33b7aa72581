"""Runs the RL workflow for a benchmark, as a user would (`pyflyte run`), and reads its MLflow runs."""

import os
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from miles_core.storage import user_cache

REPO = Path(__file__).resolve().parents[1]


def workflow_command(recipe: str, root: Path, *overrides: str) -> list[str]:
    """`pyflyte run workflows/rl.py rl` on `recipe` (plus key=value overrides) with its run root at `root`, as `make run`."""
    cfg = subprocess.run(
        [sys.executable, "-m", "miles_core.config", recipe, f"run_root={root}", *overrides], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    return [str(Path(sys.executable).parent / "pyflyte"), "run", "workflows/rl.py", "rl", "--cfg", cfg]


def run_workflow(recipe: str, root: Path, home: str, *overrides: str) -> None:
    """One local execution of workflows/rl.py with `recipe` (plus key=value overrides) under `root`;
    `home` holds its Flyte cache, so benchmarks sharing a home share cached stages; the machine's own caches stay the user's."""
    env = {**os.environ, "HOME": home, "XDG_CACHE_HOME": str(user_cache())}
    out = subprocess.run(workflow_command(recipe, root, *overrides), cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{recipe}: workflow failed\n{out.stdout[-3000:]}{out.stderr[-3000:]}")


def mlflow_runs(root: Path) -> tuple[MlflowClient, list]:
    """The client of the run root's MLflow store and every run in it."""
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    return client, client.search_runs([e.experiment_id for e in client.search_experiments()])


def metric(client: MlflowClient, run, key: str) -> dict[int, float]:
    """{step: value} of one metric of a run."""
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
