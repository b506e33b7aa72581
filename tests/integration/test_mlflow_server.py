"""The MLflow UI of `make ui`: a real `mlflow server` on 127.0.0.1 serves a finished run's
metrics, params and reward-curve artifact over its REST API."""

import json
import urllib.request

import pytest

from tests.servers import mlflow_server

pytestmark = pytest.mark.integration


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def server(smoke_run):
    root, _ = smoke_run
    with mlflow_server(f"sqlite:///{root}/mlflow.db", "--default-artifact-root", str(root / "mlartifacts")) as base:
        yield base


def test_server_serves_the_run(server):
    experiment = get(f"{server}/api/2.0/mlflow/experiments/get-by-name?experiment_name=smoke")["experiment"]
    request = urllib.request.Request(
        f"{server}/api/2.0/mlflow/runs/search",
        data=json.dumps({"experiment_ids": [experiment["experiment_id"]]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        (run,) = json.loads(response.read())["runs"]
    run_id = run["info"]["run_id"]
    history = get(f"{server}/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key=reward_mean")["metrics"]
    assert sorted(m["step"] for m in history) == [1, 2, 3]
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["name"] == "smoke"
    artifacts = get(f"{server}/api/2.0/mlflow/artifacts/list?run_id={run_id}")["files"]
    assert any(f["path"].endswith("reward_curve.png") for f in artifacts)
