"""Where a run's MLflow tracking goes: the recipe's key, else the pod's MLFLOW_TRACKING_URI, else the Flyte secret
mlflow/tracking_uri, else a local sqlite store."""

import pytest

from miles_core.config import ConfigError, TrackingConfig
from miles_core.tracking import tracking_uri


def test_the_recipe_key_comes_first(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://cluster-mlflow:5000")
    assert tracking_uri(TrackingConfig(tracking_uri="http://recipe-mlflow:5000"), "s3://bucket/runs") == "http://recipe-mlflow:5000"


def test_the_pods_environment_names_the_clusters_server(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://cluster-mlflow:5000")
    assert tracking_uri(TrackingConfig(), "s3://bucket/runs") == "http://cluster-mlflow:5000"


def test_a_local_run_root_keeps_a_sqlite_store(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(TrackingConfig(), str(tmp_path)) == f"sqlite:///{tmp_path}/mlflow.db"


def test_an_object_store_root_without_a_server_is_refused_by_key(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match=r"tracking.tracking_uri: run_root s3://bucket/runs is in an object store, .*MLFLOW_TRACKING_URI"):
        tracking_uri(TrackingConfig(), "s3://bucket/runs")


def test_a_flyte_secret_names_the_server_when_the_environment_does_not(monkeypatch):
    """The secret mlflow/tracking_uri as flytekit's secrets manager finds it in a pod (_FSEC_MLFLOW_TRACKING_URI; or its file)."""
    from tasks.tracking import _secret_server

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert _secret_server() == ""
    monkeypatch.setenv("_FSEC_MLFLOW_TRACKING_URI", " http://secret-mlflow:5000\n")
    secret = _secret_server()
    assert secret == "http://secret-mlflow:5000"
    assert tracking_uri(TrackingConfig(), "s3://bucket/runs", secret) == secret
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env-mlflow:5000")
    assert tracking_uri(TrackingConfig(), "s3://bucket/runs", secret) == "http://env-mlflow:5000"
