"""Replays through `pyflyte run` (workflows/replay.py) of a 2-iteration smoke run, from iteration 1 with a changed learning
rate: on the parent's cached rollouts, and on regenerated ones for one iteration more. Counted from the run root's files: what a replay
reuses (the Flyte cache's artifacts) writes nothing new, what it changes does."""

import json
import subprocess

import pytest
from mlflow.tracking import MlflowClient

from miles_core.config import load_recipe
from miles_core.replay import replayed
from miles_core.storage import sha256_file
from tests.conftest import REPO, run_workflow, workflow_command, workflow_env

pytestmark = pytest.mark.flyte

CHANGE = "train.lr=0.002"  # 4x the learning rate: a different update from the first step it trains (a tighter clip binds only
# where a ratio moved past it, which a small step on this model may not)
N = 1


def policies(root) -> dict[str, str]:
    """{policy directory name: sha256 of its weights} of every published policy under a run root."""
    return {p.parent.name: sha256_file(p) for p in root.glob("policy/*/model.safetensors")}


def rollouts(root) -> set[str]:
    return {p.name for p in root.glob("rollout/*.parquet") if ".buffer" not in p.name}


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    base = tmp_path_factory.mktemp("replay")
    root, home = base / "runs", base / "home"
    run_workflow("recipes/smoke.yaml", root, home, "iterations=2")
    return root, home


def replay(root, home, mode: str, *changes: str) -> subprocess.CompletedProcess:
    command = workflow_command("recipes/smoke.yaml", root, "iterations=2", workflow=("workflows/replay.py", "replay"))
    args = ["--from_iteration", str(N), "--changes", json.dumps([CHANGE, *changes]), "--rollouts", mode]
    out = subprocess.run([*command, *args], cwd=REPO, env=workflow_env(home), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def replay_run(root):
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id], order_by=["attributes.start_time DESC"])
    return client, runs[0], runs[-1]  # the newest (the replay) and the first (the parent)


def test_a_replay_on_cached_rollouts_trains_the_parents_batches_again_from_iteration_n(parent):
    root, home = parent
    before_rollouts, before_policies = rollouts(root), policies(root)
    replay(root, home, "cached")
    assert rollouts(root) == before_rollouts  # every batch the replay trained on is the parent's: none generated
    new = {name: digest for name, digest in policies(root).items() if name not in before_policies}
    assert len(new) == 2 - N  # iterations N.. trained again, published anew
    assert not set(new.values()) & set(before_policies.values())  # each a policy the parent never had
    client, run, parent_run = replay_run(root)
    assert run.data.tags["replay.parent_run_id"] == parent_run.info.run_id and run.data.tags["replay.from_iteration"] == str(N)
    assert run.data.tags["replay.rollouts"] == "cached" and run.data.params["train.lr"] == "0.002"
    assert run.info.status == "FINISHED"
    reward = [m.value for m in client.get_metric_history(run.info.run_id, "reward_mean")]
    parent_reward = [m.value for m in client.get_metric_history(parent_run.info.run_id, "reward_mean")]
    assert reward == parent_reward  # the same batches, scored by the parent, at every iteration


def test_a_regenerating_replay_reuses_the_rollouts_up_to_n_and_generates_after(parent):
    root, home = parent
    before = rollouts(root)
    replay(root, home, "regenerate", "iterations=3")
    # iteration N's rollout is the parent's (same policy, same settings): a cache hit; the one after is new
    assert len(rollouts(root) - before) == 3 - N - 1
    client, run, parent_run = replay_run(root)
    assert run.data.tags["replay.rollouts"] == "regenerate" and run.data.tags["replay.parent_run_id"] == parent_run.info.run_id
    assert run.data.tags["policy_sha256"] != parent_run.data.tags["policy_sha256"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [1, 2, 3]


def test_what_a_replay_cannot_change_is_refused_by_key():
    parent = load_recipe(REPO / "recipes/smoke.yaml", {"iterations": 2})
    assert replayed(parent, [CHANGE], N, "cached").train.lr == 0.002
    refusals = {
        ("rollout.temperature=0.5", "cached"): "rollout.temperature: a replay with rollouts cached cannot change it",
        ("sft.steps=3", "regenerate"): "sft.steps: a replay with rollouts regenerate cannot change it",
        ("train.lora.rank=4", "regenerate"): "train.lora.rank:",
        ("iterations=5", "cached"): "iterations:",
    }
    for (change, mode), message in refusals.items():
        with pytest.raises(ValueError, match=message):
            replayed(parent, [change], N, mode)
    with pytest.raises(ValueError, match="from_iteration: must be in"):
        replayed(parent, [CHANGE], 2, "cached")
    with pytest.raises(ValueError, match="nothing changed"):
        replayed(parent, [], N, "regenerate")
    with pytest.raises(ValueError, match="rollouts: must be one of"):
        replayed(parent, [CHANGE], N, "offline")
