"""cluster.keep_checkpoints: which checkpoints the loop prunes, read from the futures files its dynamic nodes write, and
a local run that prunes, resumes after the pruned ones and refuses a replay from one, with the reason."""

import dataclasses
import json
import subprocess

import pytest
from flytekit.models.literals import Literal

from miles_core.config import AsyncConfig, ClusterConfig, EvalConfig, RunConfig
from miles_core.retention import TOMBSTONE
from tasks.local_cache import artifact_uris
from tests.conftest import REPO, run_workflow, workflow_command, workflow_env
from tests.flyte.futures import DATASET, POLICY, RUN, block_futures, futures, nodes_by_task
from workflows.rl import rl_loop

pytestmark = pytest.mark.flyte

PRUNE = "tasks.retention.prune_checkpoint"


def config(iterations: int, keep: int, every: int, block: int = 20, schedule: AsyncConfig = AsyncConfig()) -> RunConfig:
    cluster = ClusterConfig(block_iterations=block, keep_checkpoints=keep, keep_checkpoints_every=every)
    return dataclasses.replace(RunConfig(), iterations=iterations, cluster=cluster, evaluation=EvalConfig(interval=5), async_phase=schedule)


def inputs(node) -> dict:
    return {b.var: b.binding for b in node.inputs}


def source(by_id: dict, binding) -> str:
    """What a checkpoint input is bound to: 'train <iteration>' or 'phase <first iteration>' (that node's output), or the
    URI of a checkpoint the block was given."""
    if binding.promise is not None:
        node = by_id[binding.promise.node_id]
        if node.task_node.reference_id.name == "tasks.async_phase.async_phase":
            return f"phase {inputs(node)['first_iteration'].scalar.primitive.integer}"
        return f"train {inputs(node)['iteration'].scalar.primitive.integer}"
    (uri,) = artifact_uris(Literal(scalar=binding.scalar))
    return uri


def prunes(spec) -> list[tuple[int, str, str]]:
    """(iterations done, the checkpoint pruned, the newer one it waits for) of every prune node of a futures file."""
    by_id = {n.id: n for n in spec.nodes}
    out = []
    for node in nodes_by_task(spec).get(PRUNE, []):
        bound = inputs(node)
        out.append((bound["iterations_done"].scalar.primitive.integer, source(by_id, bound["ckpt"]), source(by_id, bound["newer"])))
    return sorted(out)


def test_each_iteration_prunes_the_checkpoint_keep_checkpoints_before_its_own_once_its_own_exists():
    spec = block_futures(config(12, keep=2, every=5), 0, 12)
    # the checkpoint after n iterations is train n-1's; after 0, the converted start the block was given; 0, 5, 10 kept
    expected = [(n, f"train {n - 1}" if n else "s3://runs/checkpoint/0", f"train {n + 1}") for n in (1, 2, 3, 4, 6, 7, 8, 9)]
    assert prunes(spec) == expected


def test_a_block_prunes_the_checkpoints_the_block_before_left_it():
    spec = block_futures(config(15, keep=2, every=0, block=5), 5, 10)
    assert prunes(spec) == [
        (4, "s3://runs/checkpoint/4", "train 5"),
        (5, "s3://runs/checkpoint/5", "train 6"),
        (6, "train 5", "train 7"),
        (7, "train 6", "train 8"),
        (8, "train 7", "train 9"),
    ]
    recent = next(o.binding for o in spec.outputs if o.var == "recent")
    assert [by.promise.var for by in recent.collection.bindings] == ["o0", "o0"]  # the two newest: trains 8 and 9


def test_an_async_phase_prunes_as_an_iteration_does():
    mixed = AsyncConfig(schedule="mixed", sync_iterations=2, steps_per_phase=3, max_staleness=0)
    spec = block_futures(config(8, keep=1, every=0, schedule=mixed), 0, 8)
    # written after 0, 1, 2, 5 and 8 iterations: the last one kept
    assert prunes(spec) == [(0, "s3://runs/checkpoint/0", "train 0"), (1, "train 0", "train 1"), (2, "train 1", "phase 2"), (5, "phase 2", "phase 5")]


def test_keeping_every_checkpoint_builds_no_prune_node_and_carries_none():
    spec = block_futures(config(12, keep=0, every=0), 0, 12)
    assert PRUNE not in nodes_by_task(spec)
    loop = futures(rl_loop, cfg=config(30, keep=0, every=0), start=POLICY, dataset=DATASET, run=RUN)
    first = nodes_by_task(loop)["workflows.rl.rl_block"][0]
    assert inputs(first)["recent"].collection.bindings == []


def test_the_first_block_starts_with_the_converted_checkpoint_as_the_newest():
    loop = futures(rl_loop, cfg=config(30, keep=2, every=0), start=POLICY, dataset=DATASET, run=RUN)
    convert = nodes_by_task(loop)["tasks.rl.convert"][0]
    first = nodes_by_task(loop)["workflows.rl.rl_block"][0]
    assert [b.promise.node_id for b in inputs(first)["recent"].collection.bindings] == [convert.id]


def checkpoints(root) -> dict[int, set[str]]:
    """{iterations done: the names of the files its checkpoint folder holds} under a run root."""
    return {int(d.name[:4]): {p.name for p in d.iterdir()} for d in (root / "checkpoint").iterdir() if d.is_dir() and not d.name.startswith(".")}


def test_a_run_prunes_resumes_after_the_pruned_checkpoints_and_refuses_a_replay_from_one(tmp_path):
    root, home, keep = tmp_path / "runs", tmp_path / "home", ("cluster.keep_checkpoints=1", "cluster.keep_checkpoints_every=2", "sft.steps=10")
    run_workflow("recipes/smoke.yaml", root, home, "iterations=4", *keep)
    after_four = checkpoints(root)
    assert sorted(after_four) == [0, 1, 2, 3, 4]
    assert {n for n, files in after_four.items() if files == {TOMBSTONE}} == {1, 3}  # 0, 2, 4: after a multiple of 2, or the newest
    assert all("trainer_state.json" in after_four[n] for n in (0, 2, 4))
    record = json.loads((next((root / "checkpoint").glob("0003-*")) / TOMBSTONE).read_text())
    assert (record["iterations_done"], record["keep_checkpoints"], record["keep_checkpoints_every"]) == (3, 1, 2)

    run_workflow("recipes/smoke.yaml", root, home, "iterations=6", *keep)  # iterations 0-3 cache hits; 4 and 5 from the kept one
    after_six = checkpoints(root)
    assert {n for n, files in after_six.items() if files == {TOMBSTONE}} == {1, 3, 5}
    assert after_six[4] == after_four[4] and "trainer_state.json" in after_six[6]

    command = workflow_command("recipes/smoke.yaml", root, "iterations=6", *keep, workflow=("workflows/replay.py", "replay"))
    args = ["--from_iteration", "3", "--changes", json.dumps(["train.lr=0.002"]), "--rollouts", "cached"]
    out = subprocess.run([*command, *args], cwd=REPO, env=workflow_env(home), capture_output=True, text=True, timeout=900)
    assert out.returncode != 0
    assert "pruned after 3 iterations by cluster.keep_checkpoints=1, keep_checkpoints_every=2" in "".join((out.stdout + out.stderr).split("\n"))
