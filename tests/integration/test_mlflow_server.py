"""The MLflow UI of `make ui`: a real `mlflow server` on 127.0.0.1 serves a finished run's
metrics, params and reward-curve artifact over its REST API."""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def server(smoke_run):
    root, _ = smoke_run
    port = free_port()
    mlflow = Path(sys.executable).parent / "mlflow"
    proc = subprocess.Popen(
        [
            str(mlflow),
            "server",
            "--backend-store-uri",
            f"sqlite:///{root}/mlflow.db",
            "--default-artifact-root",
            str(root / "mlartifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None, "mlflow server exited"
            assert time.monotonic() < deadline, "mlflow server not healthy within 120 s"
            time.sleep(0.5)
    yield base
    proc.terminate()
    proc.wait(timeout=30)


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
