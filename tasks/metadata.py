"""What every task declares besides its code: pod resources, retries, timeout, interruptible, cache serialization;
and what a recipe changes of it (its `cluster` and GPU keys), applied by the workflow to the nodes it builds.

Declared defaults are the cluster section's defaults, so a node the workflow does not override (the preparation
tasks in the static part of `rl`) runs like a recipe that changed nothing. Retries count recoverable failures only
(tasks/retry.py says which). Every cached task serializes its cache: two executions that reach the same cache key
(a relaunch while the first still runs, the convert workflow beside an RL run of the same recipe) compute it once,
the second waiting for the first's output instead of paying for the same GPUs again.
"""

from __future__ import annotations

from datetime import timedelta

from flytekit import Resources
from flytekit.extras.accelerators import GPUAccelerator

from containers.images import cpu_image, image_for
from miles_core.config import ClusterConfig, RunConfig

SMALL = Resources(cpu="1", mem="2Gi")  # tracking, admission, the dynamic nodes that only build the loop
MEDIUM = Resources(cpu="2", mem="8Gi")  # the CPU defaults of the stages: data, SFT, rollout, score, train, evaluate
DEFAULTS = ClusterConfig()
INTERRUPTIBLE = ("rollout", "score", "teacher", "evaluate")  # cached and restartable from their inputs: losing a spot node costs one retry


def cached(version: str) -> dict:
    """The @task arguments of a cached task: its cache version, and a serialized cache."""
    return {"cache": True, "cache_version": version, "cache_serialize": True}


def declared(stage: str, resources: Resources = MEDIUM, minutes: int = 0) -> dict:
    """The @task arguments of a stage's task: requests = limits, the default retries, its timeout (`minutes`, or the
    cluster section's for a loop stage) and interruptible for the stages that may run on spot nodes."""
    timeout = timedelta(minutes=minutes or DEFAULTS.timeout_s(stage) // 60)
    return {"requests": resources, "limits": resources, "retries": DEFAULTS.retries, "timeout": timeout, "interruptible": stage in INTERRUPTIBLE}


def pod_resources(gpus: int, memory_gb: int) -> dict:
    """A pod's requests and limits from the recipe: its GPUs with 8 CPUs each, and memory_gb GiB of host memory
    (0 = 64 per GPU). Neither GPUs nor memory: {} (the task's own defaults)."""
    if not gpus and not memory_gb:
        return {}
    mem = f"{memory_gb or 64 * gpus}Gi"
    resources = Resources(cpu=str(8 * gpus), mem=mem, gpu=str(gpus)) if gpus else Resources(mem=mem)
    return {"requests": resources, "limits": resources}


def stage_overrides(cfg: RunConfig, stage: str) -> dict:
    """`with_overrides` arguments for a loop stage's node (all at once: each call replaces the node's accelerator):
    the recipe's retries, the stage's timeout, interruptible where the stage may be, the pod's GPUs (the SGLang
    servers' for rollout and evaluate, the trainer's for train), their type and memory, and its image
    (containers/images.py `image_for`) where it is not the CPU image every task declares."""
    cluster = cfg.cluster
    gpus, memory_gb = {
        "rollout": (cfg.rollout.gpus(), cfg.rollout.memory_gb),
        "evaluate": (cfg.rollout.gpus(), cfg.rollout.memory_gb),
        "train": (cfg.train.gpus_per_node, cfg.train.memory_gb),
    }.get(stage, (0, 0))
    out = {"retries": cluster.retries, "timeout": timedelta(seconds=cluster.timeout_s(stage)), **pod_resources(gpus, memory_gb)}
    image = image_for(cfg, stage)
    if image is not cpu_image:  # the image every task declares
        out["container_image"] = image.image_name()
    if stage in INTERRUPTIBLE:
        out["interruptible"] = cluster.interruptible
    if gpus and cluster.accelerator:
        out["accelerator"] = GPUAccelerator(cluster.accelerator)
    return out


# the pod of a dynamic node, which only builds part of the workflow (the loop's blocks, the evaluation before RL); no
# timeout: on a cluster a dynamic node's deadline would also bound the nodes it builds
BUILDER = {"requests": SMALL, "limits": SMALL, "retries": DEFAULTS.retries}
