"""`rl_recipe`: the RL workflow on a recipe file (what a cluster user passes as a FlyteFile) with key=value overrides,
through a real `pyflyte run`: a recipe written elsewhere that extends a shipped recipe by name runs to its report; a
misspelt key fails the first task with the file and the key named."""

import subprocess

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import PYFLYTE, REPO, workflow_env
from tests.flyte.test_compile import compile_entity
from workflows.rl import rl_recipe

pytestmark = pytest.mark.flyte


def run_recipe_file(recipe, home, *overrides: str) -> subprocess.CompletedProcess:
    command = [str(PYFLYTE), "run", "workflows/rl.py", "rl_recipe", "--recipe", str(recipe), "--overrides", repr(list(overrides)).replace("'", '"')]
    return subprocess.run(command, cwd=REPO, env=workflow_env(home), capture_output=True, text=True, timeout=900)


def test_the_recipe_is_read_by_its_own_task_before_the_rl_workflow():
    nodes = compile_entity(rl_recipe).template.nodes
    assert nodes[0].task_node.reference_id.name == "tasks.prepare.read_recipe"
    assert nodes[1].workflow_node.sub_workflow_ref.name == "workflows.rl.rl" and "n0" in nodes[1].upstream_node_ids


def test_a_recipe_file_extending_a_shipped_recipe_runs_to_its_report(tmp_path):
    recipe = tmp_path / "elsewhere" / "mine.yaml"
    recipe.parent.mkdir()
    recipe.write_text("extends: smoke.yaml  # not beside this file: the shipped recipes/smoke.yaml\nname: from_a_file\niterations: 1\n")
    out = run_recipe_file(recipe, tmp_path / "home", "sft.steps=20", f"run_root={tmp_path / 'runs'}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "final policy v2" in out.stdout
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("from_a_file").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["sft.steps"] == "20"


def test_a_misspelt_key_fails_the_first_task_naming_the_file_and_the_key(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("extends: smoke.yaml\nname: misspelt\nrollout: {n_sample: 4}\n")
    out = run_recipe_file(recipe, tmp_path / "home")
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert f"{recipe}: rollout.n_sample: unknown key (did you mean n_samples" in log
    assert "read_recipe" in log
