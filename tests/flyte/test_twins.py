"""Every real-size recipe's tiny twin (recipes/tiny/*.yaml) runs end to end through a real `pyflyte run` on CPU: the
recipe's algorithm and optimizer, the tiny model of its family, one iteration on 2 gloo processes: its megatron backend
in bf16 with its parallel layout scaled down, or, for a family the megatron converter does not take yet, the torch
backend data parallel.

The slower tier (1.5-2 minutes a twin on the development machine): deselected by pyproject's addopts; run it with
`make test-twins` (or `pytest -m twins`).
"""

import json
import subprocess

import pytest

from miles_core.config import load_recipe
from tests.conftest import REPO, workflow_command, workflow_env

pytestmark = [pytest.mark.flyte, pytest.mark.twins]

TWINS = sorted(p.stem for p in (REPO / "recipes" / "tiny").glob("*.yaml"))


@pytest.mark.parametrize("name", TWINS)
def test_twin_runs_end_to_end(tmp_path, name):
    recipe = f"recipes/tiny/{name}.yaml"
    cfg = load_recipe(REPO / recipe)
    root = tmp_path / "runs"
    out = subprocess.run(workflow_command(recipe, root), cwd=REPO, env=workflow_env(tmp_path / "home"), capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "held-out greedy accuracy: before RL" in out.stdout
    (state,) = [json.loads(p.read_text()) for p in root.glob("checkpoint/*/trainer_state.json") if json.loads(p.read_text())["step"]]
    train = cfg.train
    assert state["backend"] == train.backend
    model_parallel = {"tensor": train.tensor_parallel, "pipeline": train.pipeline_parallel, "expert": train.expert_parallel}
    assert state["parallel"] == ({**model_parallel, "world_size": 2} if train.backend == "megatron" else {"world_size": 2})
    assert state["step"] == train.mini_batches  # the recipe's optimizer steps per rollout batch
