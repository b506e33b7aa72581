"""Where an Elastic task's function runs: one process of the torch backend in the task's own process, anything else in
the workers torch elastic forks; the pod builds the same variant again from its arguments."""

import os
import subprocess
import sys

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


LOADED: dict[str, int] = {}


def _load(tag: str) -> None:
    LOADED[tag] = os.getpid()


@resizable_task(_load, task_config=OneNode(nnodes=1, nproc_per_node=1, start_method="fork", monitor_interval=0.02))
def loaded(tag: str) -> str:
    """Which process loaded what the function reads for its input, and the process the function ran in."""
    return f"{LOADED.get(tag)} {os.getpid()}"


@pytest.mark.parametrize("in_process", [True, False])
def test_a_one_process_variant_runs_where_it_is_told(in_process):
    variant = sized(where, 1, 1, in_process=in_process)
    tag, pid, _ = variant(tag="x").split()
    assert tag == "x" and (int(pid) == os.getpid()) == in_process


def test_a_forked_worker_finds_what_the_tasks_preload_loaded_in_the_agent_for_its_inputs():
    agent, worker = sized(loaded, 1, 1)(tag="y").split()
    assert int(agent) == os.getpid() != int(worker)


def test_the_agent_of_a_megatron_task_loads_megatron_for_its_workers_and_of_a_torch_task_nothing():
    """In a new process, since this one may have megatron-core loaded already."""
    code = (
        "import sys; from miles_core.config import TrainConfig; from miles_core.train.backends import preload; "
        "from miles_core.train.megatron import cpu_compat; "
        "preload(TrainConfig(backend='torch', nproc_per_node=2)); print('megatron.core' in sys.modules); "
        "preload(TrainConfig(backend='megatron')); print('megatron.core' in sys.modules, cpu_compat._active)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "True"]


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
