"""workflows/rl.py at smoke size as one async phase of two steps, every task run as a Flyte pod runs it
(tests/pods/emulator.py), tracking to a real `mlflow server` on loopback.

The phase's pod starts Ray in itself, as the Ray plugin does outside a KubeRay cluster; its rollout and trainer actors
fetch the policy, checkpoint and reference from the object store, and the trainer actor stores its checkpoint and
published policy there (tasks/async_phase.py). The pods before and after it see only the store.
"""

import json

import pytest
from flytekit.core.type_engine import TypeEngine
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from miles_core.batch_io import read_batch
from miles_core.config.recipe import load_recipe
from tasks.tracking import Report
from tests.servers import mlflow_server
from workflows.rl import rl

pytestmark = pytest.mark.pods


@pytest.fixture(scope="module")
def phase_run(store, cluster, tmp_path_factory):
    mlruns = tmp_path_factory.mktemp("mlflow")
    with mlflow_server(f"sqlite:///{mlruns}/mlflow.db", "--serve-artifacts", "--artifacts-destination", str(mlruns / "artifacts")) as uri:
        cfg = load_recipe("recipes/smoke_async.yaml", {"run_root": store.uri("async-run"), "iterations": 2, "tracking.tracking_uri": uri})
        yield cfg, uri, cluster.run(rl, cfg=cfg)


def test_the_phase_ran_as_a_pod_and_left_checkpoint_policy_and_batches_in_the_store(store, phase_run, tmp_path):
    cfg, _, run = phase_run
    assert set(run.nodes.values()) == {"ran"} and "tasks.async_phase.async_phase" in run.tasks.values()
    (phase,) = {k.split("/async/")[1].split("/")[0] for k in store.keys(store.uri("async-run", "async"))}
    prefix = store.uri("async-run", "async", phase)
    names = {k.removeprefix(prefix + "/") for k in store.keys(prefix)}
    assert {"policy/model.safetensors", "policy/policy.json", "batches/ledger.json"} <= names
    assert {"batches/step-0000.parquet", "batches/step-0001.parquet"} <= names and any(n.startswith("checkpoint/") for n in names)
    store.files.get_data(f"{prefix}/batches", str(tmp_path / "batches"), is_multipart=True)
    batches = [read_batch(tmp_path / "batches" / f"step-000{i}.parquet", scored=True) for i in range(2)]
    assert [len(b) for b in batches] == [cfg.rollout.prompts_per_step * cfg.rollout.n_samples] * 2
    ledger = json.loads((tmp_path / "batches" / "ledger.json").read_text())
    assert ledger["weight_versions"] == [1, 3]


def test_the_next_pod_loads_the_phases_policy_from_the_store_and_mlflow_has_both_steps(store, phase_run, tmp_path):
    _, uri, run = phase_run
    with store.context() as ctx:
        report = TypeEngine.to_python_value(ctx, run.outputs.literals["o0"], Report)
        store.files.get_data(report.policy.dir.remote_source, str(tmp_path / "policy"), is_multipart=True)
    assert report.policy.version == 3 and report.policy.dir.remote_source.startswith(store.uri("async-run", "async"))
    AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    client = MlflowClient(tracking_uri=uri)
    assert [m.step for m in client.get_metric_history(report.tracking.run_id, "async_staleness_mean")] == [1, 2]
