"""Elastic tasks whose processes the recipe sets: nnodes x nproc_per_node are known only when the loop runs.

flytekit 1.16 fixes an Elastic task's kind (a standalone pod for one node, a PyTorchJob for more) and its
replica count when the task is defined; a node's `task_config` override changes neither (and changes the task
object itself). And the pod that runs a task builds it again from its module and name, with the Elastic config
it was defined with, which decides how many processes torch elastic starts there. So a run calls `sized(task,
nnodes, nproc, ...)`: the same task (name, cache version, image, resources) defined with the recipe's sizes, worker-
group restarts and rendezvous timeouts (what the pod's torch elastic launch reads), whose resolver writes them into the
pod's arguments and builds the same variant in the pod. `redefined` is that definition for any task made with
`resizable_task` (the async phase's Ray cluster is sized the same way, tasks/async_phase.py). A variant of one node
meets no other agent, so it skips torch elastic's dynamic rendezvous (`OneNodeElasticTask`); a variant of one process
whose work needs no process group runs in the task's own process (`OneProcessTask`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from collections.abc import Callable

from flytekit import task
from flytekit.core.base_task import TaskResolverMixin
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.python_function_task import PythonFunctionTask
from flytekit.core.task import TaskPlugins
from flytekit.core.tracker import TrackedInstance
from flytekitplugins.kfpytorch import Elastic
from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask

from miles_core.config import ClusterConfig
from miles_core.net import free_port

_TASK_ARGS: dict[str, dict] = {}  # "module.function" -> the @task arguments it was defined with
_PRELOADS: dict[str, Callable] = {}  # "module.function" -> what its agent loads before forking workers


def resizable_task(preload: Callable | None = None, **task_args):
    """@task(**task_args) for a task that `redefined` can define again with another task_config (`sized`: an Elastic
    task's nnodes and nproc_per_node). `preload(**inputs)`: called in the process a one-node variant forks its workers
    from, just before it does, to load there once what each worker would otherwise load again (`OneNodeElasticTask`)."""

    def define(fn):
        _TASK_ARGS[_key(fn)] = task_args
        if preload is not None:
            _PRELOADS[_key(fn)] = preload
        return task(**task_args)(fn)

    return define


def _key(fn) -> str:
    return f"{fn.__module__}.{fn.__name__}"


@functools.cache
def sized(base, nnodes: int, nproc_per_node: int, max_restarts: int = 0, rdzv_timeout_s: int = 900, rdzv_join_timeout_s: int = 900, in_process: bool = False):
    """`base` (defined by `resizable_task`) with nnodes x nproc_per_node processes, `max_restarts` restarts of a failed worker
    group, and the rendezvous timeouts (seconds) of its nodes; everything else as defined. `in_process`: its one process
    (1 x 1) is the task's own (`OneProcessTask`), for work that needs no process group."""
    if in_process and (nnodes, nproc_per_node) != (1, 1):
        raise ValueError(f"only a task of one process runs in its own process, not {nnodes} x {nproc_per_node}")
    config = dataclasses.replace(
        base.task_config,
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        max_restarts=max_restarts,
        rdzv_configs={"timeout": rdzv_timeout_s, "join_timeout": rdzv_join_timeout_s},
    )
    if nnodes == 1:
        kind = OneProcess if in_process else OneNode
        config = kind(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    return redefined(base, task_config=config, task_resolver=elastic_resolver)


def redefined(base, **changes):
    """The task `base` (defined by `resizable_task`) defined again with `changes` to its @task arguments."""
    fn = base.task_function
    args = _TASK_ARGS[_key(fn)]
    outside = FlyteContextManager.current_context().with_compilation_state(None)  # defined inside a workflow, it would take its resolver
    with FlyteContextManager.with_context(outside):
        variant = task(**{**args, **changes})(fn)
    # flytekit prefixes a task's name with the module of the nearest module-level frame that created it: here the
    # caller's (pytest's or pyflyte's entry point), not the task's own. The variant takes the base task's, so its
    # name (what the spec registers and the local cache keys on) is the base task's, wherever it is built.
    variant._instantiated_in = base.instantiated_in
    return variant


def elastic(base, cluster: ClusterConfig, nnodes: int = 1, nproc_per_node: int = 1, in_process: bool = False):
    """`base` sized for a run: its processes, and the recipe's restarts and rendezvous timeouts (cluster section);
    `in_process`: a task of one process runs in its own (`sized`)."""
    one_process = in_process and nnodes == nproc_per_node == 1
    return sized(base, nnodes, nproc_per_node, cluster.max_restarts, cluster.rdzv_timeout_s, cluster.rdzv_join_timeout_s, one_process)


# (argument name, Elastic field or rendezvous key) in the order the resolver writes and reads them
_SIZES = (("nnodes", "nnodes"), ("nproc-per-node", "nproc_per_node"), ("max-restarts", "max_restarts"))
_RDZV = (("rdzv-timeout", "timeout"), ("rdzv-join-timeout", "join_timeout"))


class ElasticResolver(TrackedInstance, TaskResolverMixin):
    """Loads `sized(module.function, ...)` from the arguments it wrote at serialization."""

    def name(self) -> str:
        return "ElasticResolver"

    def load_task(self, loader_args: list[str]):
        _, module, _, name, *numbers = loader_args
        return sized(getattr(importlib.import_module(module), name), *(int(n) for n in numbers[1::2]))

    def loader_args(self, settings, t) -> list[str]:
        fn, config = t.task_function, t.task_config
        numbers = [(arg, getattr(config, field)) for arg, field in _SIZES] + [(arg, config.rdzv_configs[key]) for arg, key in _RDZV]
        numbers.append(("in-process", int(isinstance(config, OneProcess))))
        return ["task-module", fn.__module__, "task-name", fn.__name__, *(str(x) for pair in numbers for x in pair)]

    def get_all_tasks(self) -> list:
        return []


elastic_resolver = ElasticResolver()


@dataclasses.dataclass
class OneNode(Elastic):
    """An Elastic config of one node (nnodes=1): the task runs as `OneNodeElasticTask`."""


class OneNodeElasticTask(PytorchElasticFunctionTask):
    """A one-node Elastic task whose agent meets no other agent: torch elastic's static rendezvous on a free local port
    instead of the dynamic c10d one, which sleeps a random 0-0.3 s before a first round and records each of its steps
    with a stack inspection (about 0.25 s of every such task: the train and the publish task of every iteration). Its
    workers find each other through the agent's store as before. The compiled spec is the plugin's for one node (a
    plain pod, no PyTorchJob): the rendezvous is chosen where the task runs. The port is picked just before the agent
    binds it (on a cluster the pod's own; locally another process would have to take that port in between). The
    task's `preload` (`resizable_task`) runs first: the workers fork with what it loaded."""

    def __init__(self, task_config: OneNode, task_function, **kwargs):
        super().__init__(dataclasses.replace(task_config, rdzv_configs={**task_config.rdzv_configs, "rank": 0}), task_function, **kwargs)
        self.rdzv_backend = "static"  # the plugin's launch reads it; set to c10d by its __init__

    def execute(self, **kwargs):
        preload = _PRELOADS.get(_key(self.task_function))
        if preload is not None:
            preload(**kwargs)
        before = os.environ.get("PET_RDZV_ENDPOINT")
        os.environ["PET_RDZV_ENDPOINT"] = f"127.0.0.1:{free_port()}"  # where the plugin's launch reads the endpoint
        try:
            return super().execute(**kwargs)
        finally:
            if before is None:
                del os.environ["PET_RDZV_ENDPOINT"]
            else:
                os.environ["PET_RDZV_ENDPOINT"] = before


@dataclasses.dataclass
class OneProcess(OneNode):
    """An Elastic config of one node and one process whose work needs no process group: the task runs as `OneProcessTask`."""


class OneProcessTask(OneNodeElasticTask):
    """A one-process Elastic task that runs its function in the task's own process, as a plain task: no agent, no forked
    worker. A forked worker pays again, on every run of the task, what its process had not loaded yet (about 0.3 s of
    lazy imports and first-call set-up of the checkpoint and batch readers on each train task of a local run), and
    computes on one thread (it cannot start OpenMP again after a fork); in the task's own process all of that is paid
    once and its threads are the process's. The compiled spec is the one-node plugin's (a plain pod), as for every
    one-node variant. Only for work with no process group of its own (the torch backend's: one process, world size 1),
    which would otherwise outlive the task in the process."""

    def execute(self, **kwargs):
        return PythonFunctionTask.execute(self, **kwargs)


TaskPlugins.register_pythontask_plugin(OneNode, OneNodeElasticTask)
TaskPlugins.register_pythontask_plugin(OneProcess, OneProcessTask)
