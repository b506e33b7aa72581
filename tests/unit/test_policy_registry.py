"""The MLflow model registry of published policies on a local sqlite store, without Flyte: each policy a run
publishes is a version of `<experiment>-policy` whose source is the published directory, tagged with its lineage,
and `load_policy` finds iteration N of a run again."""

import logging

import fsspec
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file, save_file

from miles_core import tracking
from miles_core.retention import Pruned, prune
from miles_core.weights.manifest import MANIFEST_FILE, write_manifest

RUN_TAGS = {"config_hash": "c0ffee", "data_hash": "da7a", "code_digest": "c0de", "flyte.execution_id": "p:d:exec1"}


def published(root, version: int) -> tuple[str, dict]:
    """A published policy directory (weights + lineage manifest) as the publish task leaves it."""
    policy = root / f"policy/{version:04d}-abc"
    policy.mkdir(parents=True)
    save_file({"w": torch.full((2, 3), float(version)), "b": torch.arange(3.0) * version}, str(policy / "model.safetensors"))
    (policy / "config.json").write_text("{}")
    return str(policy), write_manifest(policy, version, version - 1, source=f"checkpoint/{version:04d}")


@pytest.fixture
def run(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = tracking.start_run(uri, "arith", str(tmp_path / "mlartifacts"), "arith-1", params={"seed": 0}, tags=RUN_TAGS)
    return uri, run_id


def test_each_published_policy_is_a_version_with_its_lineage(run, tmp_path):
    uri, run_id = run
    policies = [published(tmp_path, version) for version in (1, 2, 3)]
    versions = [tracking.register_policy(uri, run_id, path, manifest, iteration) for iteration, (path, manifest) in enumerate(policies)]
    assert [int(v.version) for v in versions] == [1, 2, 3] and {v.name for v in versions} == {"arith-policy"}

    third = MlflowClient(tracking_uri=uri).get_model_version("arith-policy", "3")
    assert third.source == policies[2][0] and third.run_id == run_id
    lineage = {"run_id": run_id, "iteration": "2", "policy_version": "3", "parent_version": "2", "policy_dir": policies[2][0]}
    assert third.tags == lineage | {"weights_sha256": policies[2][1]["weights_sha256"]} | RUN_TAGS


def test_the_runs_of_an_experiment_share_its_registered_model(run, tmp_path):
    """The first policy of the experiment creates the model; a later run's policies are versions of the same model,
    each with its own run's lineage."""
    uri, first = run
    other_tags = RUN_TAGS | {"config_hash": "beef", "flyte.execution_id": "p:d:exec2"}
    second = tracking.start_run(uri, "arith", str(tmp_path / "mlartifacts"), "arith-2", params={"seed": 1}, tags=other_tags)
    registered = [tracking.register_policy(uri, run_id, *published(tmp_path / run_id, 1), 0) for run_id in (first, second)]
    assert [(v.name, int(v.version), v.run_id) for v in registered] == [("arith-policy", 1, first), ("arith-policy", 2, second)]
    assert [v.tags["config_hash"] for v in registered] == ["c0ffee", "beef"]
    assert len(MlflowClient(tracking_uri=uri).search_registered_models()) == 1


def test_registering_a_policy_again_keeps_its_version(run, tmp_path):
    """A retried tracking task registers the same policy of the same run once."""
    uri, run_id = run
    path, manifest = published(tmp_path, 4)
    first = tracking.register_policy(uri, run_id, path, manifest, 3)
    assert tracking.register_policy(uri, run_id, path, manifest, 3).version == first.version
    assert len(MlflowClient(tracking_uri=uri).search_model_versions("name = 'arith-policy'")) == 1


def test_iteration_n_of_a_run_loads_back_its_exact_weights(run, tmp_path):
    uri, run_id = run
    policies = [published(tmp_path, version) for version in (1, 2, 3)]
    for iteration, (path, manifest) in enumerate(policies):
        tracking.register_policy(uri, run_id, path, manifest, iteration)
    for iteration, (path, _) in enumerate(policies):
        loaded = tracking.load_policy(uri, "arith-policy", run_id=run_id, iteration=iteration, dst_path=str(tmp_path / f"load{iteration}"))
        assert loaded.startswith(str(tmp_path / f"load{iteration}"))  # a copy, not the published directory
        got, want = load_file(f"{loaded}/model.safetensors"), load_file(f"{path}/model.safetensors")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert tracking.load_policy(uri, "arith-policy", version=2) == policies[1][0]  # a local source is its own directory
    with pytest.raises(LookupError, match=r"arith-policy .* no version for iteration 7 of run"):
        tracking.load_policy(uri, "arith-policy", run_id=run_id, iteration=7)


def test_a_pruned_policy_is_still_registered_and_loading_it_says_it_was_pruned(run, tmp_path):
    """cluster.keep_policies false: the run's tracking registered the policy before its folder was pruned (the manifest
    stays, so a resumed run registers it again); loading it names the setting instead of failing on missing weights."""
    uri, run_id = run
    path, manifest = published(tmp_path, 2)
    tracking.register_policy(uri, run_id, path, manifest, 1)
    record = {"kind": "policy", "iterations_done": 1, "keep_checkpoints": 1, "keep_checkpoints_every": 0}
    prune(fsspec.filesystem("file"), path, record, keeping=(MANIFEST_FILE,))
    with pytest.raises(Pruned, match=r"policy .*: pruned after 1 iterations by cluster.keep_checkpoints=1"):
        tracking.load_policy(uri, "arith-policy", run_id=run_id, iteration=1, dst_path=str(tmp_path / "load"))


def test_an_unreachable_registry_warns_and_keeps_the_published_policy(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    path, manifest = published(tmp_path, 2)
    with caplog.at_level(logging.WARNING, logger="miles_core.tracking"):
        assert tracking.register_policy("http://127.0.0.1:9", "run1", path, manifest, 1) is None  # nothing listens on port 9
    (record,) = caplog.records
    assert record.message.startswith(f"MLflow model registry: policy v2 ({path}) of run run1 not registered in http://127.0.0.1:9: ")
    assert load_file(f"{path}/model.safetensors")["w"].eq(2.0).all()
