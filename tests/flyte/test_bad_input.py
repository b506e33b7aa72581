"""Bad input through the real workflow: a clear error naming file, row and key, and nothing under
the run root lost."""

import json
import subprocess
import sys

import pytest

from miles_core.storage import sha256_file
from tests.conftest import REPO, workflow_command, workflow_env

pytestmark = pytest.mark.flyte


def snapshot(root):
    return {p: sha256_file(p) for p in root.rglob("*") if p.is_file() and p.name != "mlflow.db" and not p.name.startswith(".")}


def test_malformed_prompt_file_fails_naming_row_and_key_and_keeps_the_run_root(smoke_run, tmp_path):
    root, _ = smoke_run
    before = snapshot(root)
    good = {"input": "1+2=", "label": "3", "metadata": {"id": "a"}}
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps(good) + "\n" + json.dumps({"input": "   ", "label": "4"}) + "\n")
    test = tmp_path / "test.jsonl"
    test.write_text(json.dumps(good) + "\n")
    out = subprocess.run(
        workflow_command("recipes/smoke.yaml", root, f"data.train_file={train}", f"data.test_file={test}"),
        cwd=REPO, env=workflow_env(tmp_path / "home"), capture_output=True, text=True, timeout=600,
    )
    assert out.returncode != 0
    log = " ".join((out.stdout + out.stderr).split())
    assert f"{train}: row 2" in log and "'input'" in log and "empty" in log
    assert snapshot(root) == before


def test_malformed_recipe_stops_before_any_task(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("rollout: {n_samples: -3}\n")
    out = subprocess.run([sys.executable, "-m", "miles_core.config", str(recipe)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and f"{recipe}: rollout.n_samples: must be > 0" in out.stderr


def test_make_run_refuses_a_bad_recipe(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("train: {lr: zero}\n")
    out = subprocess.run(["make", "run", f"RECIPE={recipe}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "train.lr: expected float" in out.stderr
    assert "Running Execution" not in out.stdout  # pyflyte never started
