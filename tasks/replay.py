"""The tasks of a replay (workflows/replay.py): its config, checked before anything runs, and its lineage in MLflow."""

from __future__ import annotations

from flytekit import task

from containers.images import cpu_image
from miles_core import tracking
from miles_core.config import RunConfig, config_hash
from miles_core.replay import replayed
from tasks.common import Tracking
from tasks.metadata import SMALL, declared
from tasks.retry import recoverable


@task(container_image=cpu_image, **declared("read_recipe", SMALL, minutes=10))
@recoverable
def replay_config(parent: RunConfig, changes: list[str], from_iteration: int, rollouts: str) -> RunConfig:
    """The config the replay runs from `from_iteration` on: the parent's with `changes`; what a replay cannot change is
    refused here, by key, before any other task runs."""
    return replayed(parent, changes, from_iteration, rollouts)


@task(cache=False, container_image=cpu_image, **declared("tracking", SMALL, minutes=15))
@recoverable
def tag_replay(run: Tracking, parent: RunConfig, from_iteration: int, rollouts: str) -> Tracking:
    """The replay's MLflow run, tagged with its parent (the parent config's newest run in the parent's experiment), N and
    the mode; returned for the loop to log to."""
    parent_run = tracking.newest_run(run.uri, parent.tracking.experiment or parent.name, {"config_hash": config_hash(parent)})
    tags = {"replay.parent_config_hash": config_hash(parent), "replay.from_iteration": from_iteration, "replay.rollouts": rollouts}
    tracking.set_tags(run.uri, run.run_id, tags | {"replay.parent_run_id": parent_run or "none found"})
    print(f"replay of run {parent_run or '(none found in MLflow)'} from iteration {from_iteration}, rollouts {rollouts}", flush=True)
    return run
