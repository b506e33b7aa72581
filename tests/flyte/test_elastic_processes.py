"""Where an Elastic task's function runs: one process of the torch backend in the task's own process, anything else in
the workers torch elastic forks; the pod builds the same variant again from its arguments."""

import os

import pytest
import torch

from miles_core.config import ClusterConfig, TrainConfig
from tasks import rl as rl_tasks
from tasks.elastic import OneNode, OneProcess, elastic, elastic_resolver, resizable_task, sized
from tests.flyte.test_compile import SETTINGS, compile_entity

pytestmark = pytest.mark.flyte


@resizable_task(task_config=OneNode(nnodes=1, nproc_per_node=1, start_method="fork", monitor_interval=0.02))
def where(tag: str) -> str:
    """The process and thread count the function ran with."""
    return f"{tag} {os.getpid()} {torch.get_num_threads()}"


@pytest.mark.parametrize("in_process", [True, False])
def test_a_one_process_variant_runs_where_it_is_told(in_process):
    variant = sized(where, 1, 1, in_process=in_process)
    tag, pid, _ = variant(tag="x").split()
    assert tag == "x" and (int(pid) == os.getpid()) == in_process


def test_the_pod_builds_the_in_process_variant_again():
    variant = elastic(rl_tasks.publish, ClusterConfig(), in_process=True)  # as the workflow defines it
    args = elastic_resolver.loader_args(SETTINGS, variant)
    assert args[args.index("in-process") + 1] == "1"
    assert elastic_resolver.load_task(args) is variant
    pods = [compile_entity(t).template for t in (variant, elastic(rl_tasks.publish, ClusterConfig()))]
    assert (pods[0].type, pods[0].custom) == (pods[1].type, pods[1].custom)  # the same pod: only where the function runs differs


@pytest.mark.parametrize(
    "backend, nproc, kind",
    [("torch", 1, OneProcess), ("megatron", 1, OneNode), ("torch", 2, OneNode)],
)
def test_only_the_torch_backends_single_process_runs_in_the_tasks_process(backend, nproc, kind):
    """megatron makes a process group even for one process; several processes need their workers."""
    assert type(rl_tasks.train_task(TrainConfig(backend=backend, nproc_per_node=nproc)).task_config) is kind
