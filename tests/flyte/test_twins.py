"""Every real-size recipe's tiny twin (recipes/tiny/*.yaml) runs end to end through a real `pyflyte run` on CPU: the
recipe's algorithm, optimizer and megatron backend in bf16, its parallel layout scaled to 2 gloo processes, the tiny
model of its family, one iteration.

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

# What stops a twin before it trains, outside this tier: {model.arch: the error the run shows}. Admission
# (weights/check.py) expects transformers 5's fused expert tensors, which the tiny builder's save_pretrained writes
# per expert: every qwen3_moe checkpoint is refused. The twin passes once that is fixed.
BLOCKED = {"qwen3_moe": "experts.gate_up_proj missing from the weight files"}


@pytest.mark.parametrize("name", TWINS)
def test_twin_runs_end_to_end(tmp_path, name):
    recipe = f"recipes/tiny/{name}.yaml"
    cfg = load_recipe(REPO / recipe)
    root = tmp_path / "runs"
    out = subprocess.run(workflow_command(recipe, root), cwd=REPO, env=workflow_env(tmp_path / "home"), capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    blocker = BLOCKED.get(cfg.model.arch)
    if out.returncode and blocker and blocker in " ".join(log.split()):  # the error as printed, wrapped at spaces
        pytest.xfail(f"admission refuses the tiny {cfg.model.arch} checkpoint: {blocker}")
    assert out.returncode == 0, log[-4000:]
    assert "held-out greedy accuracy: before RL" in out.stdout
    (state,) = [json.loads(p.read_text()) for p in root.glob("checkpoint/*/trainer_state.json") if json.loads(p.read_text())["step"]]
    train = cfg.train
    assert state["parallel"] == {"tensor": train.tensor_parallel, "pipeline": train.pipeline_parallel, "expert": train.expert_parallel, "world_size": 2}
    assert state["step"] == train.mini_batches  # the recipe's optimizer steps per rollout batch
