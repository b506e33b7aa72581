"""What a cluster reads of every task and node, in the compiled spec (local execution ignores all of it): each task's
declared resources, retries, timeout, interruptible and cache serialization; and a recipe's cluster section (retries,
timeouts, spot nodes, GPU type, elastic restarts and rendezvous) on the nodes the loop builds, read from the futures
files the loop's dynamic nodes write."""

from datetime import timedelta

import pytest

from miles_core.config import ClusterConfig, load_recipe
from tasks.async_phase import async_phase
from tasks.retry import recoverable
from tasks.tracking import log_phase
from tests.conftest import REPO
from tests.flyte.futures import DATASET, POLICY, RUN, block_futures, futures, nodes_by_task, template_of
from tests.flyte.test_compile import CACHED, UNCACHED, compile_entity
from workflows.rl import evaluate_start, rl_block, rl_loop

pytestmark = pytest.mark.flyte

EVERY_TASK = [*CACHED, async_phase, *UNCACHED, log_phase]
INTERRUPTIBLE = {"tasks.rl.rollout", "tasks.rl.score", "tasks.distill.teach", "tasks.rl.evaluate"}


@pytest.mark.parametrize("task", EVERY_TASK, ids=lambda t: t.name)
def test_every_task_declares_resources_retries_a_timeout_and_where_it_may_be_interrupted(task):
    template = compile_entity(task).template
    assert len(template.container.resources.requests) == 2  # CPU and memory
    assert template.metadata.retries.retries == ClusterConfig().retries
    assert timedelta(minutes=10) <= template.metadata.timeout <= timedelta(hours=12)
    assert template.metadata.interruptible == (task.name in INTERRUPTIBLE)
    assert template.metadata.cache_serializable == template.metadata.discoverable  # every cached task serializes its cache


def test_the_loops_dynamic_nodes_are_small_pods_with_retries():
    for dynamic in (rl_loop, rl_block, evaluate_start):
        template = compile_entity(dynamic).template
        assert {r.value for r in template.container.resources.requests} == {"1", "2Gi"}
        assert template.metadata.retries.retries == ClusterConfig().retries


CLUSTER = {
    "cluster.retries": 5,
    "cluster.interruptible": False,
    "cluster.accelerator": "nvidia-h200",
    "cluster.rollout_timeout_min": 31,
    "cluster.score_timeout_min": 32,
    "cluster.train_timeout_min": 33,
    "cluster.publish_timeout_min": 34,
    "cluster.evaluate_timeout_min": 35,
    "cluster.convert_timeout_min": 36,
    "cluster.max_restarts": 7,
    "cluster.rdzv_timeout_s": 1200,
    "cluster.rdzv_join_timeout_s": 2400,
}


@pytest.fixture(scope="module")
def two_nodes():
    """One sync iteration and the loop's top level of a 2-node x 8-GPU recipe with every cluster key changed, as the
    dynamic nodes write them: {task name: (node, template)}."""
    cfg = load_recipe(REPO / "recipes" / "qwen3_5_27b.yaml", {**CLUSTER, "iterations": 1})
    block = block_futures(cfg, 0, 1)
    loop = futures(rl_loop, cfg=cfg, start=POLICY, dataset=DATASET, run=RUN)
    return {name: (nodes[0], template_of(spec, nodes[0])) for spec in (block, loop) for name, nodes in nodes_by_task(spec).items()}


@pytest.mark.parametrize(
    "name, stage, gpus",
    [
        ("rollout", "rollout", 8),
        ("score", "score", 0),
        ("train", "train", 8),
        ("publish", "publish", 0),
        ("evaluate", "evaluate", 8),
        ("convert", "convert", 0),
    ],
)
def test_the_recipe_sets_retries_timeout_interruptible_and_gpu_type_of_each_node(two_nodes, name, stage, gpus):
    node, _ = two_nodes[f"tasks.rl.{name}"]
    assert node.metadata.retries.retries == 5
    assert node.metadata.timeout == timedelta(minutes=CLUSTER[f"cluster.{stage}_timeout_min"])
    assert node.metadata.interruptible is False  # the recipe's: rollout, score and evaluate declare True
    extended = node.task_node.overrides.extended_resources
    assert (extended.gpu_accelerator.device if extended and extended.gpu_accelerator else "") == ("nvidia-h200" if gpus else "")


def test_the_elastic_tasks_restart_and_rendezvous_as_the_recipe_says(two_nodes):
    _, train = two_nodes["tasks.rl.train"]
    elastic = train.custom["elasticConfig"]  # a PyTorchJob of 2 worker pods
    assert (elastic["minReplicas"], elastic["maxReplicas"], elastic["nprocPerNode"], elastic["maxRestarts"]) == (2, 2, 8, 7)
    for name in ("train", "convert", "publish"):  # each pod builds its task again from these: its torch elastic launch reads them
        args = two_nodes[f"tasks.rl.{name}"][1].container.args
        written = {args[i]: args[i + 1] for i in range(args.index("nnodes"), len(args), 2)}
        assert written == {
            "nnodes": "2" if name == "train" else "1",
            "nproc-per-node": "8" if name == "train" else "1",
            "max-restarts": "7",
            "rdzv-timeout": "1200",
            "rdzv-join-timeout": "2400",
            "in-process": "0",  # megatron's tasks, one process or more, run in the workers torch elastic starts
        }


def test_an_async_phase_node_takes_the_recipes_retries_and_timeout():
    cfg = load_recipe(REPO / "recipes" / "smoke_async.yaml", {"iterations": 2, "cluster.retries": 4, "cluster.async_timeout_min": 99})
    (phase,) = nodes_by_task(block_futures(cfg, 0, 2))["tasks.async_phase.async_phase"]
    assert (phase.metadata.retries.retries, phase.metadata.timeout) == (4, timedelta(minutes=99))


def test_a_recipe_that_changes_nothing_runs_with_the_declared_defaults():
    cfg = load_recipe(REPO / "recipes" / "smoke.yaml", {"iterations": 1})
    block = block_futures(cfg, 0, 1)
    for name, (node,) in nodes_by_task(block).items():
        declared = template_of(block, node).metadata
        if name != "tasks.tracking.log_iteration":
            assert (node.metadata.retries.retries, node.metadata.timeout) == (declared.retries.retries, declared.timeout), name
        assert node.metadata.interruptible is declared.interruptible is (name in INTERRUPTIBLE)
        assert not node.task_node.overrides.resources and not node.task_node.overrides.extended_resources  # CPU pods as declared


def test_only_transient_errors_become_recoverable():
    """Flyte retries a user error only when it is a FlyteRecoverableException: a dropped connection is one, a bug is not."""
    from flytekit.exceptions.user import FlyteRecoverableException

    def fails_with(err):
        @recoverable
        def task_body():
            raise err

        return task_body

    for transient in (ConnectionResetError("reset by peer"), TimeoutError("read timed out")):
        with pytest.raises(FlyteRecoverableException, match="transient: retried"):
            fails_with(transient)()
    try:
        raise ConnectionRefusedError("sglang server")
    except ConnectionRefusedError as cause:
        wrapped = RuntimeError("rollout failed")
        wrapped.__cause__ = cause
    with pytest.raises(FlyteRecoverableException):
        fails_with(wrapped)()
    with pytest.raises(ValueError, match="bad batch"):
        fails_with(ValueError("bad batch"))()
