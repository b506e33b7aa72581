"""A real `pyflyte run` of the workflow with a sync iteration then async phases, killed with SIGKILL
mid-phase and re-run: the finished phase comes from the cache, and across the phases' consumed
batches, the dropped samples and the final buffer every drawn prompt's samples appear exactly once."""

import json
import os
import signal
import subprocess
import time
from collections import Counter

import pytest
from mlflow.tracking import MlflowClient

from miles_core.async_buffer import draw_of
from miles_core.batch_io import read_batch
from miles_core.config import load_recipe
from tests.conftest import REPO, run_workflow, workflow_command, workflow_env

pytestmark = pytest.mark.flyte

RECIPE = "recipes/smoke_async.yaml"
# mixed: one sync iteration, then phases at iterations 1-2 and 3-4
OVERRIDES = ("sft.steps=60", "iterations=5", "async_phase.schedule=mixed", "async_phase.sync_iterations=1")


def ray_processes_of(session: int) -> list[int]:
    """Ray processes left in the killed run's session (Ray's own daemons may leave its process group)."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,comm="], capture_output=True, text=True).stdout.split("\n")
    return [int(pid) for pid, sid, *_ in (line.split() for line in out if line.strip()) if int(sid) == session]


def kill_mid_second_phase(root, home, log) -> None:
    with open(log, "w") as out:
        proc = subprocess.Popen(
            workflow_command(RECIPE, root, *OVERRIDES), cwd=REPO, env=workflow_env(home), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 600
    # the second phase has begun (the first is complete by then)
    while "async phase: steps 4-5 starting" not in log.read_text():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.2)  # polling interval, not synchronisation
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid in ray_processes_of(proc.pid):
        os.kill(pid, signal.SIGKILL)
    assert not list(root.glob("async/0003-*/checkpoint")), "the second phase finished before the kill"


def test_async_phases_resume_after_a_kill_without_losing_or_repeating_a_sample(tmp_path):
    root, home = tmp_path / "runs", tmp_path / "home"
    kill_mid_second_phase(root, home, tmp_path / "killed.log")
    (first_phase,) = root.glob("async/0001-*")
    first_batches = sorted(p.name for p in (first_phase / "batches").iterdir())

    resumed = run_workflow(RECIPE, root, home, *OVERRIDES)
    log = resumed.stdout + resumed.stderr
    assert log.count("Cache hit") >= 8  # model, data, sft, evaluate, convert, the sync iteration's tasks, the first phase ...
    assert "async phase: steps 2-3" not in log  # the first phase was not run again
    assert sorted(p.name for p in (first_phase / "batches").iterdir()) == first_batches

    phases = sorted(root.glob("async/[0-9]*"))  # not the killed attempt's temporary folder
    assert [p.name[:4] for p in phases] == ["0001", "0003"]
    cfg = load_recipe(REPO / RECIPE)
    consumed = [s for phase in phases for f in sorted((phase / "batches").glob("*.parquet")) for s in read_batch(f, scored=True)]
    assert len(consumed) == 4 * cfg.rollout.prompts_per_step * cfg.rollout.n_samples
    for s in consumed:
        assert s.weight_version >= s.metadata["trainer_version"] - cfg.async_phase.max_staleness
    ledgers = [json.loads((p / "batches" / "ledger.json").read_text()) for p in phases]
    left = read_batch(phases[-1] / "buffer.parquet", scored=True) if (phases[-1] / "buffer.parquet").exists() else []
    ended = Counter([f"{draw_of(s)}/{s.index}" for s in consumed + left] + [d for ledger in ledgers for d in ledger["dropped"]])
    start, end = (ledger["epoch"] * cfg.data.train_size + ledger["offset"] for ledger in (ledgers[0]["state_before"], ledgers[-1]["state_after"]))
    assert start == cfg.rollout.prompts_per_step  # after the sync iteration's prompts
    assert ended == Counter(f"{d}/{i}" for d in range(start, end) for i in range(cfg.rollout.n_samples))  # each exactly once

    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("smoke_async").experiment_id], order_by=["attributes.start_time DESC"])[0]
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [1, 2, 3, 4, 5]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "async_staleness_mean")] == [2, 3, 4, 5]  # the async steps
    versions = client.search_model_versions(f"name = 'smoke_async-policy' and tags.run_id = '{run.info.run_id}'")
    # the SFT start, the sync iteration's policy and each async phase's, registered at the phase's last iteration
    assert sorted((int(v.tags["iteration"]), int(v.tags["policy_version"])) for v in versions) == [(0, 1), (1, 2), (3, 4), (5, 6)]
    for key in (
        "async_queue_depth_mean",
        "async_staleness_mean",
        "async_trainer_idle_s",
        "async_rollout_idle_s",
        "async_weight_push_s",
        "async_samples_per_s",
        "async_tokens_per_s",
        "train_loss",
    ):
        assert key in run.data.metrics, key
