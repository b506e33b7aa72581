"""workflows/rl.py at smoke size (one iteration) with every task run as a Flyte pod runs it (tests/pods/emulator.py),
the `@dynamic` nodes' sub-nodes included, tracking to a real `mlflow server` on loopback.

Emulated: flytepropeller, datacatalog and the pod (see the emulator). Real: the compiled spec, `pyflyte-execute`, the
2-process Elastic train task, flytekit's uploads and downloads, the S3 server, the MLflow server. The run root is a URI
in the store; the pods share nothing else.
"""

import pytest
import torch
from flytekit.core.type_engine import TypeEngine
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from miles_core import tracking
from miles_core.config.recipe import load_recipe
from tasks.tracking import Report
from tests.servers import mlflow_server
from workflows.rl import rl

pytestmark = pytest.mark.pods

CACHED = ["base_model", "admit_model", "make_data", "sft", "evaluate", "convert", "rollout", "score", "train", "publish", "evaluate"]


@pytest.fixture(scope="module")
def rl_runs(store, cluster, tmp_path_factory):
    """The smoke recipe for one iteration, twice with the same config; the MLflow server keeps its artifacts itself."""
    mlruns = tmp_path_factory.mktemp("mlflow")
    with mlflow_server(f"sqlite:///{mlruns}/mlflow.db", "--serve-artifacts", "--artifacts-destination", str(mlruns / "artifacts")) as uri:
        cfg = load_recipe("recipes/smoke.yaml", {"run_root": store.uri("rl"), "iterations": 1, "tracking.tracking_uri": uri})
        yield uri, cluster.run(rl, cfg=cfg), cluster.run(rl, cfg=cfg)


def short(task: str) -> str:
    return task.rsplit(".", 1)[-1]


def test_every_task_ran_as_a_pod_dynamic_sub_nodes_included(store, rl_runs):
    _, first, _ = rl_runs
    assert set(first.nodes.values()) == {"ran"}
    path_of = {short(task): path for path, task in first.tasks.items()}
    assert all("/" in path_of[t] for t in ("convert", "rollout", "score", "train", "publish", "log_iteration"))  # the loop's sub-nodes
    stages = {key.removeprefix(store.uri("rl") + "/").split("/")[0] for key in store.keys(store.uri("rl"))}
    assert {"base", "data", "sft", "checkpoint", "rollout", "scored", "policy"} <= stages


def test_the_iteration_is_tracked_in_one_mlflow_run_and_the_final_policy_loads_from_the_store(store, rl_runs, tmp_path):
    uri, first, _ = rl_runs
    with store.context() as ctx:
        report = TypeEngine.to_python_value(ctx, first.outputs.literals["o0"], Report)
        store.files.get_data(report.policy.dir.remote_source, str(tmp_path / "policy"), is_multipart=True)
    assert report.policy.version == 2  # SFT start (v1) + one iteration
    AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(report.tracking.run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [1]
    assert run.data.tags["policy_dir"] == report.policy.dir.remote_source  # lineage names the store, not a pod's disk


def test_the_published_policies_are_registered_through_the_server_and_load_from_the_store(store, rl_runs, tmp_path, monkeypatch):
    """The registered version's source is the policy's URI in the store; loading iteration 1 downloads it from there."""
    uri, first, _ = rl_runs
    with store.context() as ctx:
        report = TypeEngine.to_python_value(ctx, first.outputs.literals["o0"], Report)
        store.files.get_data(report.policy.dir.remote_source, str(tmp_path / "policy"), is_multipart=True)
    found = MlflowClient(tracking_uri=uri).search_model_versions(f"name = 'smoke-policy' and tags.run_id = '{report.tracking.run_id}'")
    assert sorted(int(v.tags["iteration"]) for v in found) == [0, 1]
    assert {v.source for v in found if v.tags["iteration"] == "1"} == {report.policy.dir.remote_source}
    for key, value in {"MLFLOW_S3_ENDPOINT_URL": store.endpoint, "AWS_ACCESS_KEY_ID": "pods", "AWS_SECRET_ACCESS_KEY": "pods-secret"}.items():
        monkeypatch.setenv(key, value)  # the reader's own credentials for the store
    loaded = tracking.load_policy(uri, "smoke-policy", run_id=report.tracking.run_id, iteration=1, dst_path=str(tmp_path / "registered"))
    got, want = load_file(f"{loaded}/model.safetensors"), load_file(tmp_path / "policy" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_second_run_hits_the_cache_for_every_cached_task(rl_runs):
    _, _, again = rl_runs
    assert sorted(short(t) for t in again.by_task("cache hit")) == sorted(CACHED)
    reran = {short(t) for t in again.by_task("ran")}  # the dynamic nodes that build the loop, and the uncached tracking tasks
    assert not reran & set(CACHED) and {"start_run", "log_iteration", "finish_run"} <= reran
