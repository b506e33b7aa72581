"""The asynchronous phase as one Ray-on-Flyte task: K training steps on rollout actors and a trainer actor.

On a cluster the phase is a KubeRay job sized by the recipe (`on_ray`, `ray_cluster`): a head, a `rollout` worker
group of one pod per rollout actor (with the GPUs of the SGLang servers its engine launches, or CPUs for the embedded
engine) and a `trainer` group of one pod (one GPU when the recipe trains on GPUs: the phase trains in one process).
Each pod declares its group's Ray resource, so each actor runs in its own group (miles_core/async_loop.py
`placement`). The actors fetch the policy, checkpoint and reference from the object store and the trainer actor
stores its checkpoint and published policy there (`OBJECT_STORE`); this task writes the consumed batches, the ledger
and the buffer and returns them as uploads. Locally the Ray plugin starts Ray in this process, which declares no
groups, and every actor runs beside it. The task is cached: a phase killed at any moment re-runs from its inputs,
the previous phase's outputs.
"""

from __future__ import annotations

import functools
import json
from typing import Optional

from flytekit.types.file import FlyteFile
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig

from containers.images import cpu_image
from miles_core.async_loop import ROLLOUT_GROUP, TRAINER_GROUP, PhaseSpec
from miles_core.batch_io import read_batch
from miles_core.config import AlgoConfig, AsyncConfig, DataConfig, HealthConfig, HooksConfig, PublishConfig, RewardConfig, RolloutConfig, RunConfig, TrainConfig
from miles_core.data.source import DataState, load_prompts
from miles_core.models import vocab_size
from miles_core.phase_outputs import run_phase_into
from miles_core.plugins import plugin
from tasks.common import (
    OBJECT_STORE,
    AsyncPhaseResult,
    Checkpoint,
    Dataset,
    Policy,
    cache_version,
    member,
    new_artifact,
    stored_dir,
    uploaded_dir,
    uploaded_file,
    uri_of,
)
from tasks.elastic import redefined, resizable_task
from tasks.metadata import MEDIUM, SMALL, cached, declared, pod_resources
from tasks.retention import unpruned
from tasks.retry import recoverable


def _group(name: str, replicas: int, gpus: int, memory_gb: int) -> WorkerNodeConfig:
    """A worker group of `replicas` pods, each with `gpus` GPUs (8 CPUs each) or the CPU default, declaring the
    group's Ray resource once (one actor per pod). KubeRay reads rayStartParams' `resources` as a quoted JSON string."""
    sized = pod_resources(gpus, memory_gb) or {"requests": MEDIUM, "limits": MEDIUM}
    resources = '"' + json.dumps({name: 1}).replace('"', '\\"') + '"'
    return WorkerNodeConfig(group_name=name.removeprefix("miles_"), replicas=replicas, ray_start_params={"resources": resources}, **sized)


def sizes(cfg: RunConfig) -> tuple[int, int, int, int, int]:
    """What the recipe `cfg` sizes of the phase's cluster: rollout actors, their GPUs and memory, the trainer's GPU
    (one process: one GPU when the recipe trains on GPUs) and memory."""
    rollout, train = cfg.rollout, cfg.train
    return cfg.async_phase.rollout_workers, rollout.gpus(), rollout.memory_gb, min(train.gpus_per_node, 1), train.memory_gb


def ray_cluster(workers: int, rollout_gpus: int, rollout_memory_gb: int, train_gpus: int, train_memory_gb: int) -> RayJobConfig:
    """The phase's KubeRay cluster: a CPU head (the driver and the sample buffer, no actors), a rollout group of one
    pod per rollout actor and a trainer group of one pod."""
    return RayJobConfig(
        head_node_config=HeadNodeConfig(requests=MEDIUM, limits=MEDIUM),
        worker_node_config=[_group(ROLLOUT_GROUP, workers, rollout_gpus, rollout_memory_gb), _group(TRAINER_GROUP, 1, train_gpus, train_memory_gb)],
        shutdown_after_job_finishes=True,
        ttl_seconds_after_finished=300,
    )


@resizable_task(
    task_config=ray_cluster(*sizes(RunConfig())),  # a run's: on_ray(cfg)
    container_image=cpu_image,
    **cached(
        cache_version(AsyncConfig, RolloutConfig, DataConfig, RewardConfig, AlgoConfig, TrainConfig, HooksConfig, HealthConfig, PublishConfig, module=__name__)
    ),
    **declared("async", SMALL),  # the job's submitter pod; the head and worker groups have their own (ray_cluster)
)
@recoverable
def async_phase(
    cfg: AsyncConfig,
    rollout: RolloutConfig,
    data: DataConfig,
    reward: RewardConfig,
    algo: AlgoConfig,
    train: TrainConfig,
    hooks: HooksConfig,
    health: HealthConfig,
    publish_cfg: PublishConfig,
    ckpt: Checkpoint,
    policy: Policy,
    reference: Policy,
    dataset: Dataset,
    state: DataState,
    buffer: Optional[FlyteFile],
    first_iteration: int,
    steps: int,
    root: str,
    code: str,
) -> AsyncPhaseResult:  # noqa: UP045 (the Optional flytekit's type engine reads)
    ckpt_dir, policy_dir = uri_of(unpruned(ckpt.dir)), uri_of(unpruned(policy.dir))
    vocab = vocab_size(str(member(policy.dir, "config.json").parent))  # the weights are the actors' to fetch, not this pod's
    shape = {"scored": True, "reward_range": (reward.min, reward.max), "vocab_size": vocab, "group_size": rollout.n_samples}
    waiting = read_batch(buffer.download(), **shape) if buffer is not None else []
    spec = PhaseSpec(
        cfg=cfg,
        rollout=rollout,
        reward=reward,
        algo=algo,
        train=train,
        hooks=hooks,
        health=health,
        publish=publish_cfg,
        source_fn=plugin(data, "data", "source_fn"),
        seed=data.seed,
        prompts=load_prompts(dataset.train.download(), data.input_key, data.label_key, data.metadata_key),
        state=state,
        waiting=[waiting[i : i + rollout.n_samples] for i in range(0, len(waiting), rollout.n_samples)],
        ckpt_dir=ckpt_dir,
        policy_dir=policy_dir,
        version=policy.version,
        reference_dir=uri_of(reference.dir),
        first_iteration=first_iteration,
        steps=steps,
        transfer=OBJECT_STORE,
    )
    inputs = (cfg, rollout, reward, algo, train, hooks, health, publish_cfg, ckpt_dir, policy_dir, state, uri_of(buffer) if buffer else "")
    out, dest = new_artifact(root, "async", first_iteration, *inputs, steps, code)
    print(f"async phase: steps {first_iteration + 1}-{first_iteration + steps} starting")
    result = run_phase_into(spec, out, f"{dest}/checkpoint", f"{dest}/policy", shape)
    version = policy.version + steps
    print(
        f"async phase: steps {first_iteration + 1}-{first_iteration + steps}, {result.metrics['async/samples_per_s']:.1f} samples/s, "
        f"staleness mean {result.metrics['async/phase_staleness_mean']:.2f}, policy v{version}"
    )
    return AsyncPhaseResult(
        ckpt=Checkpoint(dir=stored_dir(f"{dest}/checkpoint"), step=int(result.metrics["train/step"])),
        policy=Policy(dir=stored_dir(f"{dest}/policy"), version=version),
        batches=uploaded_dir(out / "batches", f"{dest}/batches"),
        buffer=uploaded_file(out / "buffer.parquet", f"{dest}/buffer.parquet") if result.buffer else None,
        state=result.state,
        dropped=result.dropped,
        steps=result.steps,
        metrics=result.metrics,
    )


def on_ray(cfg: RunConfig):
    """The async_phase task on the KubeRay cluster the recipe `cfg` sizes. The pod that runs it builds the declared one:
    the cluster is KubeRay's business, the task's code the same."""
    return _on_ray(*sizes(cfg))


@functools.cache
def _on_ray(*sized: int):
    return redefined(async_phase, task_config=ray_cluster(*sized))
