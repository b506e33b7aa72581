"""A short run of the whole DAG on the megatron backend: the smoke recipe with train.backend=megatron.

The train task is a real 2-process kfpytorch Elastic task (gloo); convert and publish run megatron-core
in their own worker process.  Checks the published policies, the Megatron checkpoints (torch_dist,
one RNG file per rank: two processes really trained) and the report.
"""

import json
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import REPO, extends, final_policy, run_workflow

pytestmark = [pytest.mark.flyte, pytest.mark.integration]


@pytest.fixture(scope="module")
def megatron_run():
    with tempfile.TemporaryDirectory(prefix="megatron-dag-") as tmp:  # not pytest's rotated temp folders
        out = run_workflow("recipes/smoke.yaml", Path(tmp) / "runs", Path(tmp) / "home", "train.backend=megatron", "iterations=2")
        yield Path(tmp) / "runs", out


def test_the_dag_trains_with_two_megatron_processes(megatron_run):
    root, out = megatron_run
    checkpoints = sorted(p.parent for p in root.glob("checkpoint/*/trainer_state.json"))
    states = [json.loads((c / "trainer_state.json").read_text()) for c in checkpoints]
    assert [s["step"] for s in states] == [2, 4]  # mini_batches: 2 optimizer steps per iteration
    assert all(s["backend"] == "megatron" and s["parallel"]["world_size"] == 2 for s in states)
    assert all(sorted(p.name for p in (c / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"] for c in checkpoints)
    assert all((c / "model" / "metadata.json").exists() for c in checkpoints)  # torch_dist format


def test_published_policies_are_hf_directories_with_lineage(megatron_run):
    root, out = megatron_run
    policy = final_policy(root)
    manifest = json.loads((policy / "policy.json").read_text())
    assert manifest["parent_version"] == manifest["version"] - 1 and "checkpoint" in manifest["source"]
    assert (policy / "model.safetensors").exists() and (policy / "tokenizer.json").exists()
    assert "iteration 1" in out.stdout + out.stderr


def test_the_convert_workflow_round_trips_a_checkpoint_through_megatron_bitwise(tmp_path):
    """workflows/convert.py on a user's checkpoint (model.path): HF -> torch_dist -> HF gives back every tensor bit for bit."""
    from safetensors.torch import load_file

    from miles_core.config import ModelConfig
    from miles_core.models.tiny import build_tiny_model

    user = build_tiny_model(ModelConfig(arch="llama", seed=5), str(tmp_path / "user"))  # untied embeddings: both ends convert
    run_workflow(
        "recipes/smoke.yaml", tmp_path / "runs", tmp_path / "home", "train.backend=megatron", f"model.path={user}", workflow=("workflows/convert.py", "convert")
    )
    (exported,) = (tmp_path / "runs").glob("policy/0001-*/")
    before, after = load_file(f"{user}/model.safetensors"), load_file(exported / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((exported / "policy.json").read_text())["parent_version"] == 0


def test_ppo_trains_its_critic_beside_the_megatron_policy():
    """PPO on the megatron backend at smoke size: the critic warms up alone in iteration 1, then both train."""
    with tempfile.TemporaryDirectory(prefix="megatron-ppo-") as tmp:
        recipe, root = Path(tmp) / "ppo.yaml", Path(tmp) / "runs"
        values = yaml.safe_load((REPO / "recipes" / "smoke.yaml").read_text())
        values |= {"extends": extends(REPO / "recipes" / "ppo.yaml", recipe), "iterations": 2, "algo": {"critic_warmup_steps": 1}}
        recipe.write_text(yaml.safe_dump(values))
        run_workflow(str(recipe), root, Path(tmp) / "home", "train.backend=megatron")
        checkpoints = sorted(p.parent for p in root.glob("checkpoint/*/trainer_state.json"))
        assert [json.loads((c / "trainer_state.json").read_text())["step"] for c in checkpoints] == [0, 2]  # policy: iteration 2 only
        critic_steps = [json.loads((c / "critic" / "trainer_state.json").read_text())["step"] for c in checkpoints]
        assert critic_steps == [2, 4]  # the critic trained in both iterations (2 mini-batches each)
