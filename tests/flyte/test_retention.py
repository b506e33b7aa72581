"""cluster.keep_checkpoints: which checkpoints (and with keep_policies false, policies) the loop prunes, read from the
futures files its dynamic nodes write, and a local run that prunes, resumes after what it pruned and refuses a replay
from it, with the reason."""

import dataclasses
import json
import subprocess

import pytest
from flytekit.models.literals import Literal

from miles_core.config import AsyncConfig, ClusterConfig, EvalConfig, RunConfig
from miles_core.retention import TOMBSTONE
from miles_core.weights.manifest import MANIFEST_FILE
from tasks.local_cache import artifact_uris
from tests.conftest import REPO, run_workflow, workflow_command, workflow_env
from tests.flyte.futures import DATASET, POLICY, RUN, block_futures, futures, inputs, nodes_by_task
from workflows.rl import rl_loop

pytestmark = pytest.mark.flyte

PRUNE = "tasks.retention.prune_iteration"


def config(iterations: int, keep: int, every: int, block: int = 20, schedule: AsyncConfig = AsyncConfig(), policies: bool = True) -> RunConfig:
    cluster = ClusterConfig(block_iterations=block, keep_checkpoints=keep, keep_checkpoints_every=every, keep_policies=policies)
    return dataclasses.replace(RunConfig(), iterations=iterations, cluster=cluster, evaluation=EvalConfig(interval=5), async_phase=schedule)


def done_of(by_id: dict, binding) -> int | str | None:
    """After how many iterations the checkpoint or policy a node takes was written, where a node of the futures file
    writes it (a train or publish node of iteration i: i + 1; an async phase: its last step); else the URI of the one
    the block was given; None for no policy."""
    if binding.promise is None:  # a value: of an Optional input, the union's
        literal = binding.scalar.union.value if binding.scalar.union is not None else Literal(scalar=binding.scalar)
        return next(artifact_uris(literal), None)
    node = by_id[binding.promise.node_id]
    bound, name = inputs(node), node.task_node.reference_id.name
    if name == "tasks.async_phase.async_phase":
        return bound["first_iteration"].scalar.primitive.integer + bound["steps"].scalar.primitive.integer
    if name == "tasks.rl.publish":
        return done_of(by_id, bound["ckpt"])
    return bound["iteration"].scalar.primitive.integer + 1


def prunes(spec) -> list[tuple]:
    """(iterations done, the checkpoint pruned, the policy pruned with it, the newer checkpoint it waits for) of every
    prune node of a futures file, each named by `done_of`."""
    by_id = {n.id: n for n in spec.nodes}
    out = []
    for node in nodes_by_task(spec).get(PRUNE, []):
        bound = inputs(node)
        out.append((bound["iterations_done"].scalar.primitive.integer, *(done_of(by_id, bound[k]) for k in ("ckpt", "policy", "newer"))))
    return sorted(out)


def test_each_iteration_prunes_the_checkpoint_keep_checkpoints_before_its_own_once_its_own_exists():
    spec = block_futures(config(12, keep=2, every=5), 0, 12)
    # the checkpoints after 0, 5 and 10 iterations are kept for good; the first is the converted start the block was given
    expected = [(n, n or "s3://runs/checkpoint/0", None, n + 2) for n in (1, 2, 3, 4, 6, 7, 8, 9)]
    assert prunes(spec) == expected


def test_with_keep_policies_false_a_policy_goes_with_its_checkpoint_after_its_iteration_was_logged():
    spec = block_futures(config(8, keep=1, every=0, policies=False), 0, 8)
    # the SFT policy, the converted checkpoint's, is the reference: never pruned
    assert prunes(spec) == [(0, "s3://runs/checkpoint/0", None, 1)] + [(n, n, n, n + 1) for n in range(1, 8)]
    by_id = {n.id: n for n in spec.nodes}
    for node in nodes_by_task(spec)[PRUNE]:
        done = inputs(node)["iterations_done"].scalar.primitive.integer
        upstream = {by_id[i].task_node.reference_id.name: by_id[i] for i in node.upstream_node_ids if i in by_id}
        if done:  # the log of iteration done - 1 reads that policy's manifest: it runs first
            assert inputs(upstream["tasks.tracking.log_iteration"])["iteration"].scalar.primitive.integer == done - 1


def test_a_block_prunes_the_checkpoints_the_block_before_left_it():
    spec = block_futures(config(15, keep=2, every=0, block=5, policies=False), 5, 10)
    assert prunes(spec) == [
        (4, "s3://runs/checkpoint/4", "s3://runs/policy/4", 6),
        (5, "s3://runs/checkpoint/5", "s3://runs/policy/5", 7),
        (6, 6, 6, 8),
        (7, 7, 7, 9),
        (8, 8, 8, 10),
    ]
    recent = {o.var: o.binding for o in spec.outputs}
    by_id = {n.id: n for n in spec.nodes}
    assert [done_of(by_id, b) for b in recent["recent"].collection.bindings] == [9, 10]
    assert [done_of(by_id, b) for b in recent["recent_policies"].collection.bindings] == [9, 10]


def test_a_block_handed_fewer_checkpoints_than_it_keeps_prunes_only_those_it_holds():
    """A replay that keeps more checkpoints than its parent did is handed fewer than it keeps: the older ones are the
    parent's to keep, and each prune names a checkpoint the block holds."""
    spec = block_futures(config(12, keep=3, every=0), 5, 10, handed=1)  # handed the checkpoint after 5 iterations only
    assert prunes(spec) == [(5, "s3://runs/checkpoint/5", None, 8), (6, 6, None, 9), (7, 7, None, 10)]
    spec = block_futures(config(12, keep=1, every=0), 5, 10, handed=3)  # keeps fewer: the older ones handed stay
    assert [done for done, *_ in prunes(spec)] == [5, 6, 7, 8, 9]


def test_an_async_phase_prunes_as_an_iteration_does():
    mixed = AsyncConfig(schedule="mixed", sync_iterations=2, steps_per_phase=3, max_staleness=0)
    spec = block_futures(config(8, keep=1, every=0, schedule=mixed, policies=False), 0, 8)
    # written after 0, 1, 2, 5 and 8 iterations: the last one kept
    assert prunes(spec) == [(0, "s3://runs/checkpoint/0", None, 1), (1, 1, 1, 2), (2, 2, 2, 5), (5, 5, 5, 8)]


def test_keeping_every_checkpoint_builds_no_prune_node_and_carries_none():
    spec = block_futures(config(12, keep=0, every=0), 0, 12)
    assert PRUNE not in nodes_by_task(spec)
    loop = futures(rl_loop, cfg=config(30, keep=0, every=0), start=POLICY, dataset=DATASET, run=RUN)
    first = nodes_by_task(loop)["workflows.rl.rl_block"][0]
    assert inputs(first)["recent"].collection.bindings == inputs(first)["recent_policies"].collection.bindings == []


def test_the_first_block_starts_with_the_converted_checkpoint_as_the_newest():
    loop = futures(rl_loop, cfg=config(30, keep=2, every=0), start=POLICY, dataset=DATASET, run=RUN)
    convert = nodes_by_task(loop)["tasks.rl.convert"][0]
    first = nodes_by_task(loop)["workflows.rl.rl_block"][0]
    assert [b.promise.node_id for b in inputs(first)["recent"].collection.bindings] == [convert.id]
    (sft,) = inputs(first)["recent_policies"].collection.bindings  # the loop's own input, the SFT policy
    assert sft.promise is None


def folders(root, stage: str, offset: int = 0) -> dict[int, set[str]]:
    """{iterations done: the names of the files its folder holds} of a stage's artifacts under a run root (a policy's
    version is one more than the iterations done)."""
    return {int(d.name[:4]) - offset: {p.name for p in d.iterdir()} for d in (root / stage).iterdir() if d.is_dir() and not d.name.startswith(".")}


def pruned(found: dict[int, set[str]], *kept: str) -> set[int]:
    return {n for n, files in found.items() if files == {TOMBSTONE, *kept}}


def test_a_run_prunes_resumes_after_the_pruned_iterations_and_refuses_a_replay_from_one(tmp_path):
    root, home = tmp_path / "runs", tmp_path / "home"
    keep = ("cluster.keep_checkpoints=1", "cluster.keep_checkpoints_every=2", "cluster.keep_policies=false", "sft.steps=10")
    run_workflow("recipes/smoke.yaml", root, home, "iterations=4", *keep)
    checkpoints, policies = folders(root, "checkpoint"), folders(root, "policy", offset=1)
    assert sorted(checkpoints) == [0, 1, 2, 3, 4] and sorted(policies) == [1, 2, 3, 4]
    assert pruned(checkpoints) == {1, 3}  # 0, 2, 4: after a multiple of 2, or the newest
    assert pruned(policies, MANIFEST_FILE) == {1, 3}  # the lineage manifest stays
    assert all("trainer_state.json" in checkpoints[n] for n in (0, 2, 4)) and all("model.safetensors" in policies[n] for n in (2, 4))
    record = json.loads((next((root / "checkpoint").glob("0003-*")) / TOMBSTONE).read_text())
    assert (record["kind"], record["iterations_done"], record["keep_checkpoints"], record["keep_checkpoints_every"]) == ("checkpoint", 3, 1, 2)

    # iterations 0-3 cache hits (their logs run again, reading the pruned policies' manifests); 4 and 5 from the kept ones
    run_workflow("recipes/smoke.yaml", root, home, "iterations=6", *keep)
    assert pruned(folders(root, "checkpoint")) == pruned(folders(root, "policy", offset=1), MANIFEST_FILE) == {1, 3, 5}
    assert folders(root, "checkpoint")[4] == checkpoints[4]

    command = workflow_command("recipes/smoke.yaml", root, "iterations=6", *keep, workflow=("workflows/replay.py", "replay"))
    args = ["--from_iteration", "3", "--changes", json.dumps(["train.lr=0.002"]), "--rollouts", "cached"]
    out = subprocess.run([*command, *args], cwd=REPO, env=workflow_env(home), capture_output=True, text=True, timeout=900)
    assert out.returncode != 0
    assert "pruned after 3 iterations by cluster.keep_checkpoints=1, keep_checkpoints_every=2" in "".join((out.stdout + out.stderr).split("\n"))
