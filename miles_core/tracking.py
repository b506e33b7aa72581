"""MLflow helpers: one experiment per recipe, one run per workflow execution.

Stages return their metrics as typed outputs; only the (uncached) tracking steps write to
MLflow, so a resumed execution logs the cached iterations too and every run is complete.
mlflow is imported here only, inside the functions, because the core must import without it.
Every published policy is also a version of the experiment's registered model (`register_policy`), whose source
is the published directory itself: the weights are stored once, and `load_policy` finds them again.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from pathlib import Path

import fsspec

from miles_core.config import TrackingConfig
from miles_core.config.base import ConfigError
from miles_core.config.model import URI_SCHEMES
from miles_core.retention import check_kept
from miles_core.storage import user_cache


def tracking_uri(cfg: TrackingConfig, run_root: str, secret: str = "") -> str:
    """The recipe's tracking URI, else the pod's MLFLOW_TRACKING_URI (a cluster's MLflow server set in the task's
    environment), else `secret` (the Flyte secret mlflow/tracking_uri, where the cluster gives it to the pod), else a
    sqlite store under a local run root (an object store holds no sqlite database)."""
    uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "").strip() or secret
    if not uri and run_root.startswith(URI_SCHEMES):
        raise ConfigError(
            f"tracking.tracking_uri: run_root {run_root} is in an object store, where no sqlite MLflow store can live: name an MLflow "
            "server (or set MLFLOW_TRACKING_URI in the tasks' environment, or the Flyte secret mlflow/tracking_uri)"
        )
    return uri or f"sqlite:///{Path(run_root).resolve()}/mlflow.db"


def _client(uri: str):
    from mlflow.tracking import MlflowClient  # heavy import, only where tracking happens

    if uri.startswith("sqlite:///"):
        _seed_sqlite(Path(uri.removeprefix("sqlite:///")))
    return MlflowClient(tracking_uri=uri)


def _seed_sqlite(path: Path) -> None:
    """A sqlite store not there yet starts as a copy of an empty one of this MLflow version, made once per machine in the
    user's cache: MLflow brings a new database through every schema revision it has (1.5-2 s per run root, measured
    2026-11-27; a copy: 0.04 s). Where the cache cannot be written, MLflow makes the store itself."""
    if path.exists():
        return
    import mlflow
    from mlflow.tracking import MlflowClient

    template = user_cache() / "miles-flyte" / f"mlflow-{mlflow.__version__}-empty.db"
    try:
        if not template.exists():
            template.parent.mkdir(parents=True, exist_ok=True)
            made = template.with_name(f".{template.name}.{os.getpid()}")
            MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments()  # creates and migrates it
            os.replace(made, template)
        path.parent.mkdir(parents=True, exist_ok=True)
        copy = path.with_name(f".{path.name}.{os.getpid()}")
        shutil.copyfile(template, copy)
        try:
            os.link(copy, path)  # never over a store another process made meanwhile
        except FileExistsError:
            pass
        finally:
            copy.unlink()
    except OSError as err:
        logging.getLogger(__name__).info("MLflow store %s made by MLflow itself (no empty store to copy: %s)", path, err)


def start_run(uri: str, experiment: str, artifact_root: str | None, run_name: str, params: dict, tags: dict) -> str:
    """A new run of `experiment` (created with its artifacts under the local folder artifact_root; None: where the server keeps them)."""
    client = _client(uri)
    found = client.get_experiment_by_name(experiment)
    location = Path(artifact_root).resolve().as_uri() if artifact_root else None
    experiment_id = found.experiment_id if found else client.create_experiment(experiment, artifact_location=location)
    run = client.create_run(experiment_id, run_name=run_name, tags={k: str(v) for k, v in tags.items()})
    from mlflow.entities import Param  # heavy import, only where tracking happens

    items = [Param(k, str(v)[:6000]) for k, v in params.items()]
    for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run.info.run_id, params=items[start : start + 100])
    return run.info.run_id


def log_metrics(uri: str, run_id: str, metrics: dict[str, float], step: int) -> None:
    from mlflow.entities import Metric  # heavy import, only where tracking happens

    now = int(time.time() * 1000)
    client = _client(uri)
    client.log_batch(run_id, metrics=[Metric(k.replace("/", "_"), float(v), now, step) for k, v in metrics.items()])


def log_dict(uri: str, run_id: str, data: dict, artifact_file: str) -> None:
    _client(uri).log_dict(run_id, data, artifact_file)


def set_tags(uri: str, run_id: str, tags: dict) -> None:
    client = _client(uri)
    for key, value in tags.items():
        client.set_tag(run_id, key, str(value))


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in _client(uri).get_metric_history(run_id, key.replace("/", "_"))]


def reward_curve(uri: str, run_id: str, out_png: str) -> str:
    """Plot training reward and held-out accuracy against iteration; returns the PNG path."""
    import matplotlib  # heavy import, only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("reward/mean", "train reward (mean)"), ("eval/accuracy", "held-out greedy accuracy")):
        points = sorted(history(uri, run_id, key))
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3, label=label)
    ax.set_xlabel("iteration")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    _client(uri).log_artifact(run_id, out_png)
    return out_png


def learning_verdict(before: float, after: float, prompts: float) -> tuple[bool, str]:
    """Did RL raise held-out accuracy? True only if `after` beats `before` by more than one prompt
    of the held-out set (a single flipped answer is noise, not learning); with the message to print."""
    gained = after - before
    if gained * prompts > 1:
        return True, f"RL raised held-out accuracy by {100 * gained:.1f} points"
    return False, (
        f"WARNING: RL did not learn: held-out accuracy {before:.3f} -> {after:.3f} ({100 * gained:+.1f} points "
        f"on {prompts:.0f} prompts); the MLflow run is tagged learned=false"
    )


def end_run(uri: str, run_id: str) -> None:
    _client(uri).set_terminated(run_id)


def newest_run(uri: str, experiment: str, tags: dict[str, str], status: str = "") -> str | None:
    """The newest run of `experiment` carrying these tags (values of letters, digits and ':') and, when given, in this
    status (RUNNING, FINISHED, FAILED), or None."""
    client = _client(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    query = " and ".join([*(f"tags.`{key}` = '{value}'" for key, value in tags.items()), *([f"attributes.status = '{status}'"] if status else [])])
    runs = client.search_runs([found.experiment_id], query, order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def fail_run(uri: str, run_id: str, tags: dict) -> None:
    set_tags(uri, run_id, tags)
    _client(uri).set_terminated(run_id, status="FAILED")


# the run's tags that each of its registered policy versions carries too (set by the start_run task)
RUN_LINEAGE = ("config_hash", "data_hash", "code_digest", "flyte.execution_id")


def policy_model(experiment: str) -> str:
    """The registered model that holds an experiment's published policies, one version per policy a run publishes."""
    return f"{experiment}-policy"


def _found(client, name: str, **tags: object):
    """The registered versions of `name` carrying these tags, oldest first."""
    query = " and ".join([f"name = '{name}'", *(f"tags.`{key}` = '{value}'" for key, value in tags.items())])
    return sorted(client.search_model_versions(query), key=lambda found: int(found.version))


@functools.cache
def _registry_of(uri: str, run_id: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The registered model of a run's policies and the run's lineage tags (RUN_LINEAGE, as (key, value) pairs), which
    the start_run task set once: read once per process (a run of many iterations registers one policy an iteration)."""
    client = _client(uri)
    run = client.get_run(run_id)
    return policy_model(client.get_experiment(run.info.experiment_id).name), tuple((k, run.data.tags[k]) for k in RUN_LINEAGE if k in run.data.tags)


def _new_version(client, name: str, source: str, run_id: str, tags: dict[str, str], description: str):
    """A new version of the registered model `name`; the model is created first where it does not exist yet (the
    experiment's first policy: another run of the experiment may create it meanwhile)."""
    from mlflow.exceptions import MlflowException  # heavy import, only where tracking happens

    create = functools.partial(client.create_model_version, name, source, run_id=run_id, tags=tags, description=description)
    try:
        return create()
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    try:
        client.create_registered_model(name, description="The policies the RL runs of this experiment published")
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    return create()


def register_policy(uri: str, run_id: str, policy_uri: str, manifest: dict, iteration: int):
    """The policy published at `policy_uri` (its manifest `manifest`: weights/publish.py), the run's policy after
    `iteration` iterations, as a version of `policy_model(experiment)` whose source is that directory (nothing is
    copied), tagged with its lineage and the run's (RUN_LINEAGE). A policy the run registered before (a retried task)
    keeps its version. A tracking server that refuses or cannot be reached costs the registry entry only, with a
    warning that names it (the policy is published already): None."""
    from mlflow.exceptions import MlflowException  # heavy import, only where tracking happens

    try:
        client = _client(uri)
        name, lineage = _registry_of(uri, run_id)
        if done := _found(client, name, run_id=run_id, policy_version=manifest["version"]):
            return done[0]
        parent = manifest["parent_version"]
        tags = {
            "run_id": run_id,
            "iteration": iteration,
            "policy_version": manifest["version"],
            "parent_version": "" if parent is None else parent,
            "weights_sha256": manifest["weights_sha256"],
            "policy_dir": policy_uri,
        } | dict(lineage)
        about = f"policy v{manifest['version']} after iteration {iteration} of run {run_id}"
        return _new_version(client, name, policy_uri, run_id, {k: str(v) for k, v in tags.items()}, about)
    except (MlflowException, OSError) as error:
        logging.getLogger(__name__).warning(
            f"MLflow model registry: policy v{manifest['version']} ({policy_uri}) of run {run_id} not registered in {uri}: {error}"
        )
        return None


def load_policy(uri: str, name: str, version: int | None = None, run_id: str = "", iteration: int | None = None, dst_path: str | None = None) -> str:
    """The HF directory of a registered policy: version `version` of registered model `name`, or the policy after
    `iteration` iterations of run `run_id`. A policy in an object store is downloaded (into dst_path, else a temporary
    folder); a local one is its own directory unless dst_path asks for a copy. A policy its run pruned (its folder keeps
    the manifest and the tombstone: cluster.keep_policies) raises miles_core.retention.Pruned, saying so."""
    import mlflow  # heavy import, only where tracking happens

    client = _client(uri)
    if version is None:
        found = _found(client, name, run_id=run_id, iteration=iteration)
        if not found:
            raise LookupError(f"registered model {name} in {uri} has no version for iteration {iteration} of run {run_id!r}")
        version = found[0].version
    local = mlflow.artifacts.download_artifacts(artifact_uri=client.get_model_version_download_uri(name, version), dst_path=dst_path)
    return check_kept(fsspec.filesystem("file"), local)
