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


def runs_of(uri: str) -> list[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return [r.info.run_name for r in client.search_runs([e.experiment_id for e in client.search_experiments()])]


def test_a_new_local_store_starts_as_a_copy_of_the_machines_empty_one(tmp_path, monkeypatch):
    """MLflow migrates a new sqlite store through every schema revision; a run root's store is a copy of one migrated
    once per machine and MLflow version. Each store is its own, and one that exists is never replaced."""
    import mlflow

    from miles_core import tracking

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first, second = (f"sqlite:///{tmp_path}/root{i}/mlflow.db" for i in range(2))
    tracking.start_run(first, "exp", str(tmp_path / "artifacts"), "first", {}, {})
    empty = tmp_path / "cache" / "miles-flyte" / f"mlflow-{mlflow.__version__}-empty.db"
    assert empty.exists() and runs_of(f"sqlite:///{empty}") == []
    tracking.start_run(second, "exp", str(tmp_path / "artifacts"), "second", {}, {})
    inode = (tmp_path / "root0" / "mlflow.db").stat().st_ino
    tracking.start_run(first, "exp", str(tmp_path / "artifacts"), "again", {}, {})
    assert (tmp_path / "root0" / "mlflow.db").stat().st_ino == inode
    assert sorted(runs_of(first)) == ["again", "first"] and runs_of(second) == ["second"]


def test_without_a_writable_cache_mlflow_makes_the_store_itself(tmp_path, monkeypatch):
    from miles_core import tracking

    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-folder"))
    uri = f"sqlite:///{tmp_path}/root/mlflow.db"
    tracking.start_run(uri, "exp", str(tmp_path / "artifacts"), "only", {}, {})
    assert runs_of(uri) == ["only"]
