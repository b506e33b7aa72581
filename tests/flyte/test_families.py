"""Each algorithm family's recipe, at smoke size, runs through the real workflow and trains.

The six runs share one Flyte cache and run root, so the base model, data and SFT are computed
once and every family starts from the same SFT policy.
"""

from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from tests.conftest import REPO, extends, run_workflow

pytestmark = [pytest.mark.flyte, pytest.mark.algorithm_families]

FAMILIES = ("dapo", "gspo", "dr_grpo", "reinforce_pp", "rloo", "ppo")


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory):
    """{family: MLflow run} after two iterations of each family's recipe at smoke size."""
    base = tmp_path_factory.mktemp("families")
    smoke = yaml.safe_load((REPO / "recipes" / "smoke.yaml").read_text())
    for family in FAMILIES:
        recipe = base / f"{family}.yaml"
        values = {**smoke, "extends": extends(REPO / "recipes" / f"{family}.yaml", recipe), "name": family, "iterations": 2}
        values["algo"] = {"critic_warmup_steps": 1}  # ppo: the policy trains in the second iteration
        values["tracking"] = {"experiment": "families"}
        recipe.write_text(yaml.safe_dump(values))
        run_workflow(str(recipe), base / "runs", base / "home")
    client = MlflowClient(tracking_uri=f"sqlite:///{base}/runs/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("families").experiment_id])
    return base / "runs", client, {r.info.run_name.rsplit("-", 1)[0]: r for r in runs}


def test_every_family_finishes_in_one_experiment(family_runs):
    root, _, runs = family_runs
    assert set(runs) == set(FAMILIES) and all(r.info.status == "FINISHED" for r in runs.values())
    assert {runs[f].data.params["algo.advantage"] for f in FAMILIES} == {"grpo", "reinforce_plus_plus_baseline", "rloo", "ppo"}
    assert len(list((root / "sft").glob("*/model.safetensors"))) == 1  # one SFT, shared through the cache


def test_every_family_changes_the_policy(family_runs):
    root, _, runs = family_runs
    sft = load_file(next((root / "sft").glob("*/model.safetensors")))
    for family, run in runs.items():
        final = load_file(Path(run.data.tags["policy_dir"]) / "model.safetensors")
        assert final.keys() == sft.keys() and any(not torch.equal(final[k], sft[k]) for k in sft), family


def test_family_specific_metrics(family_runs):
    _, client, runs = family_runs
    dapo = runs["dapo"].data.metrics
    assert dapo["rollout_batch_groups"] == 8 and dapo["rollout_rounds"] >= 1  # smoke: 8 prompts per step
    assert "rollout_dropped_groups" in dapo and "rollout_buffer_groups" in dapo
    ppo = runs["ppo"].info.run_id
    assert [m.step for m in client.get_metric_history(ppo, "critic_loss")] == [1, 2]
    assert [m.step for m in client.get_metric_history(ppo, "train_loss")] == [2]  # critic warm-up in iteration 1
    assert runs["gspo"].data.params["algo.policy_loss"] == "gspo"
    assert runs["dr_grpo"].data.params["algo.loss_aggregation"] == "seq-mean-token-sum-norm"
