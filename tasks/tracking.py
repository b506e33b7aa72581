"""Tracking tasks (never cached): each workflow execution gets its own complete MLflow run,
even when its stages are served from the cache."""

from __future__ import annotations

import base64
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import flytekit
from flytekit import Deck, task
from flytekit.types.error import FlyteError

from containers.images import cpu_image
from miles_core import tracking
from miles_core.config import RunConfig, config_hash, flatten
from miles_core.config.model import URI_SCHEMES
from miles_core.models.source import SOURCE_FILE, read_source
from miles_core.plugins import STAGE_PLUGPOINTS, code_closure, plugin_code
from miles_core.storage import digest
from miles_core.weights.manifest import MANIFEST_FILE, read_manifest
from tasks.common import AsyncPhaseResult, Dataset, Policy, Tracking, member, run_root_of, uri_of
from tasks.decks import DECKS
from tasks.metadata import SMALL, declared
from tasks.retry import recoverable


@dataclass
class Report:
    accuracy_before: float
    accuracy_after: float
    learned: bool  # RL raised held-out accuracy (miles_core.tracking.learning_verdict)
    policy: Policy
    tracking: Tracking


def _secret_server() -> str:
    """The MLflow server named by the Flyte secret mlflow/tracking_uri (an environment variable or a file that the cluster
    mounts into the pod: flytekit's secrets), '' where there is none."""
    try:
        return flytekit.current_context().secrets.get("mlflow", "tracking_uri")
    except ValueError:
        return ""


def _execution_tag() -> str:
    execution = flytekit.current_context().execution_id
    return f"{execution.project}:{execution.domain}:{execution.name}"


def _code_digest(cfg: RunConfig) -> str:
    """Digest of the code this execution runs: the RL workflow's module with every project module it imports
    (transitively), and the recipe's plug-in modules of every stage."""
    workflow = code_closure("workflows.rl", ("miles_core", "tasks", "containers", "workflows"))
    return digest(workflow, [plugin_code(cfg, stage) for stage in sorted(STAGE_PLUGPOINTS)])


def _log_policy(run: Tracking, policy: Policy, iteration: int) -> None:
    """A published policy's manifest as the run's policies/vNNNN.json, and the policy as a version of the experiment's
    registered model (tracking.register_policy: a registry that fails leaves a warning, the policy stays published)."""
    manifest = read_manifest(member(policy.dir, MANIFEST_FILE).parent)
    tracking.log_dict(run.uri, run.run_id, manifest, f"policies/v{policy.version:04d}.json")
    registered = tracking.register_policy(run.uri, run.run_id, uri_of(policy.dir), manifest, iteration)
    if registered is not None:
        print(f"MLflow: policy v{policy.version} is models:/{registered.name}/{registered.version}", flush=True)


@task(cache=False, container_image=cpu_image, **declared("tracking", SMALL, minutes=15))
@recoverable
def start_run(cfg: RunConfig, dataset: Dataset, base: Policy, start: Policy, evaluation: dict[str, float]) -> Tracking:
    root = run_root_of(cfg.run_root)  # on a cluster, never the pod's own disk
    uri = tracking.tracking_uri(cfg.tracking, root, _secret_server())
    source = read_source(member(base.dir, SOURCE_FILE).parent)
    run_id = tracking.start_run(
        uri,
        cfg.tracking.experiment or cfg.name,
        None if root.startswith(URI_SCHEMES) else str(Path(root) / "mlartifacts"),  # an object-store root: the server's
        run_name=f"{cfg.name}-{config_hash(cfg)[:6]}",
        params=flatten(cfg),
        tags={
            "config_hash": config_hash(cfg),
            "data_hash": dataset.sha256,
            "parent_version": start.version,
            "model.source": source["path"],  # the base checkpoint every policy version of this run descends from
            "model.sha256": source["sha256"],
            "flyte.execution_id": _execution_tag(),
            "code_digest": _code_digest(cfg),
            "parent_policy_dir": uri_of(start.dir),
        },
    )
    tracking.log_metrics(uri, run_id, evaluation, step=0)
    print(f"tracking: MLflow run {run_id} in {uri}")
    run = Tracking(uri=uri, run_id=run_id)
    _log_policy(run, start, iteration=0)  # the policy RL starts from
    return run


@task(cache=False, container_image=cpu_image, **declared("tracking", SMALL, minutes=15))
@recoverable
def log_iteration(
    run: Tracking, iteration: int, rollout: dict[str, float], score: dict[str, float], train: dict[str, float], evaluation: dict[str, float], policy: Policy
) -> None:
    metrics = {**rollout, **score, **train, **evaluation, "time/logged_at": time.time()}
    tracking.log_metrics(run.uri, run.run_id, metrics, step=iteration + 1)
    _log_policy(run, policy, iteration + 1)
    loss = f"loss {train['train/loss']:+.4f}" if "train/loss" in train else f"critic warm-up, value loss {train['critic/loss']:.4f}"
    line = f"iteration {iteration + 1}: reward {score['reward/mean']:.3f} {loss} policy v{policy.version}"
    if evaluation:
        line += f" | held-out accuracy {evaluation['eval/accuracy']:.3f}"
    print(line, flush=True)


@task(cache=False, **DECKS, container_image=cpu_image, **declared("tracking", SMALL, minutes=15))
@recoverable
def finish_run(run: Tracking, before: dict[str, float], after: dict[str, float], policy: Policy, root: str) -> Report:
    manifest = read_manifest(member(policy.dir, MANIFEST_FILE).parent)
    learned, verdict = tracking.learning_verdict(before["eval/accuracy"], after["eval/accuracy"], after["eval/prompts"])
    tracking.set_tags(
        run.uri,
        run.run_id,
        {
            "policy_version": policy.version,
            "policy_dir": uri_of(policy.dir),
            "policy_sha256": manifest["weights_sha256"],
            "learned": str(learned).lower(),
        },
    )
    png = Path(flytekit.current_context().working_directory) / f"{run.run_id}-reward_curve.png"  # logged to the run and the deck
    tracking.reward_curve(run.uri, run.run_id, str(png))
    image = base64.b64encode(png.read_bytes()).decode()
    Deck("reward curve", f'<img src="data:image/png;base64,{image}"><p>MLflow run {run.run_id}</p>')
    tracking.end_run(run.uri, run.run_id)
    report = Report(before["eval/accuracy"], after["eval/accuracy"], learned, policy, run)
    print(f"held-out greedy accuracy: before RL {report.accuracy_before:.3f} -> after RL {report.accuracy_after:.3f}")
    print(verdict, flush=True)
    if not learned:
        logging.getLogger("miles_flyte").warning(verdict)
    print(f"MLflow: run {run.run_id} ({run.uri}); `make ui` to browse; final policy v{policy.version}: {uri_of(policy.dir)}")
    return report


@task(cache=False, container_image=cpu_image, **declared("tracking", SMALL, minutes=15))
@recoverable
def log_phase(run: Tracking, first_iteration: int, phase: AsyncPhaseResult, evaluation: dict[str, float]) -> None:
    """An async phase's K steps as K iterations (training + async metrics), its totals and evaluation at the last."""
    last = first_iteration + len(phase.steps)
    for i, step in enumerate(phase.steps):
        totals = {**phase.metrics, **evaluation} if first_iteration + i + 1 == last else {}
        tracking.log_metrics(run.uri, run.run_id, {**step, **totals, "time/logged_at": time.time()}, step=first_iteration + i + 1)
        print(
            f"iteration {first_iteration + i + 1}: reward {step['reward/mean']:.3f} loss {step['train/loss']:+.4f} "
            f"staleness {step['async/staleness_mean']:.2f} (async)",
            flush=True,
        )
    _log_policy(run, phase.policy, last)
    line = f"async phase {first_iteration + 1}-{last}: {phase.metrics['async/samples_per_s']:.1f} samples/s, policy v{phase.policy.version}"
    if evaluation:
        line += f" | held-out accuracy {evaluation['eval/accuracy']:.3f}"
    print(line, flush=True)


@task(cache=False, container_image=cpu_image, **declared("tracking", SMALL, minutes=15))
@recoverable
def mark_failed(cfg: RunConfig, err: Optional[FlyteError] = None) -> None:  # noqa: UP045 (the Optional flytekit's type engine reads)
    """The run workflow's failure handler: this execution's MLflow run ends FAILED, tagged with the node that failed,
    its error and the health gate that tripped, if one did. What the run published before it failed stays."""
    uri = tracking.tracking_uri(cfg.tracking, run_root_of(cfg.run_root), _secret_server())
    run_id = tracking.newest_run(uri, cfg.tracking.experiment or cfg.name, {"config_hash": config_hash(cfg), "flyte.execution_id": _execution_tag()}, "RUNNING")
    if run_id is None:
        print("the run failed before its MLflow run started: nothing to mark", flush=True)
        return
    message = err.message if err is not None else "unknown"
    gate = re.search(r"health gate (\w+) tripped", message)
    tags = {"failure.node": err.failed_node_id if err is not None else "", "failure.message": message[-5000:]}  # MLflow keeps 5000 characters
    tracking.fail_run(uri, run_id, tags | ({"health_gate": gate.group(1)} if gate else {}))
    print(f"MLflow: run {run_id} marked FAILED" + (f" (health gate {gate.group(1)})" if gate else ""), flush=True)
