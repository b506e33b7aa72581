"""On-policy distillation in the workflow: where the teacher's tasks sit in the loop (the futures files the dynamic
nodes write), and a real local run whose teacher task scores the batch and is a cache hit when the run is repeated."""

from datetime import timedelta

import pytest
from mlflow.tracking import MlflowClient

from miles_core.batch_io import read_batch
from miles_core.config import ModelConfig, load_recipe
from miles_core.models.tiny import build_tiny_model
from tests.conftest import REPO, run_workflow
from tests.flyte.futures import DATASET, POLICY, RUN, block_futures, futures, nodes_by_task
from workflows.rl import rl_loop

pytestmark = pytest.mark.flyte

DISTILL = {"iterations": 1, "distill.teacher": "s3://models/teacher", "cluster.teacher_timeout_min": 17, "cluster.retries": 3}


def test_the_teacher_scores_each_batch_between_score_and_train():
    spec = block_futures(load_recipe(REPO / "recipes" / "smoke.yaml", DISTILL), 0, 1)
    ids = {node.id: node.task_node.reference_id.name for node in spec.nodes}
    (teach,) = nodes_by_task(spec)["tasks.distill.teach"]
    (train,) = nodes_by_task(spec)["tasks.rl.train"]
    batch_of = {node.id: {b.var: b.binding.promise for b in node.inputs if b.binding.promise} for node in (teach, train)}
    assert ids[batch_of[teach.id]["batch"].node_id] == "tasks.rl.score"  # the scored batch in, the taught batch out to train
    assert batch_of[train.id]["batch"].node_id == teach.id
    assert (teach.metadata.timeout, teach.metadata.retries.retries, teach.metadata.interruptible) == (timedelta(minutes=17), 3, True)


def test_the_teacher_is_admitted_once_a_run_and_every_block_reads_it():
    cfg = load_recipe(REPO / "recipes" / "smoke.yaml", {**DISTILL, "iterations": 3, "cluster.block_iterations": 2})
    loop = nodes_by_task(futures(rl_loop, cfg=cfg, start=POLICY, dataset=DATASET, run=RUN))
    (admitted,) = loop["tasks.distill.teacher_model"]
    teachers = [next(b.binding.promise.node_id for b in block.inputs if b.var == "teacher") for block in loop["workflows.rl.rl_block"]]
    assert teachers == [admitted.id, admitted.id]


def test_without_a_teacher_the_loop_has_no_teacher_node():
    cfg = load_recipe(REPO / "recipes" / "smoke.yaml", {"iterations": 1})
    assert "tasks.distill.teach" not in nodes_by_task(block_futures(cfg, 0, 1))
    assert "tasks.distill.teacher_model" not in nodes_by_task(futures(rl_loop, cfg=cfg, start=POLICY, dataset=DATASET, run=RUN))


def cache_lines(log: str) -> list[str]:
    return ["hit" if "Cache hit" in line else "miss" for line in log.splitlines() if "Cache hit" in line or "Cache miss" in line]


def test_a_run_with_a_teacher_scores_its_batch_and_the_teacher_task_is_cached(tmp_path):
    """The smoke recipe's student (64 wide, 2 layers) distilled from a bigger tiny model of its tokenizer, one iteration, twice."""
    teacher = build_tiny_model(ModelConfig(hidden_size=96, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=192, seed=7), tmp_path / "teacher")
    root, home = tmp_path / "runs", tmp_path / "home"
    args = ("iterations=1", f"distill.teacher={teacher}", "distill.mode=reward")
    first = run_workflow("recipes/smoke.yaml", root, home, *args)
    assert "distillation teacher: " in first.stdout
    (distilled,) = root.glob("distilled/0000-*.parquet")
    samples = read_batch(distilled, distilled=True)  # every sample carries the teacher's log-prob of each response token
    assert all(len(s.teacher_logprobs) == len(s.response_tokens) and max(s.teacher_logprobs) < 0 for s in samples)
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert {"distill_reverse_kl", "distill_teacher_logprob", "time_teacher_s"} <= set(run.data.metrics)

    second = run_workflow("recipes/smoke.yaml", root, home, *args)
    assert cache_lines(second.stdout + second.stderr) == ["hit"] * len(cache_lines(first.stdout + first.stderr))
    assert "distillation teacher: " not in second.stdout  # the teacher's tasks did not run again
