"""The asynchronous phase as one Ray-on-Flyte task: K training steps on rollout actors and a trainer actor.

On a cluster `RayJobConfig` asks KubeRay for a head and two worker groups: `rollout` (the
rollout actors' engines) and `trainer` (the policy and its optimizer); locally the Ray plugin
starts Ray in this process. The outputs (miles_core/phase_outputs.py) are written under the run root
like every other task's, so sync iterations and further phases can follow, and the task is cached: a phase
killed at any moment re-runs from its inputs, the previous phase's outputs.
"""

from __future__ import annotations

from typing import Optional

from flytekit import Resources, task
from flytekit.types.file import FlyteFile
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig

from containers.images import cpu_image
from miles_core.async_loop import PhaseSpec
from miles_core.config import AlgoConfig, AsyncConfig, DataConfig, HooksConfig, PublishConfig, RewardConfig, RolloutConfig, TrainConfig
from miles_core.data.source import DataState, load_prompts
from miles_core.models import vocab_size
from miles_core.phase_outputs import run_phase_into
from miles_core.plugins import plugin
from miles_core.schemas import read_batch
from miles_core.storage import artifact_path, atomic_dir
from tasks.common import AsyncPhaseResult, Checkpoint, Dataset, Policy, cache_version, lasting_dir, lasting_file
from tasks.metadata import SMALL, cached, declared
from tasks.retry import recoverable

RAY_CLUSTER = RayJobConfig(
    head_node_config=HeadNodeConfig(requests=Resources(cpu="1", mem="2Gi")),
    worker_node_config=[
        WorkerNodeConfig(group_name="rollout", replicas=2, requests=Resources(cpu="2", mem="4Gi")),
        WorkerNodeConfig(group_name="trainer", replicas=1, requests=Resources(cpu="2", mem="4Gi")),
    ],
    shutdown_after_job_finishes=True,
    ttl_seconds_after_finished=300,
)


@task(
    task_config=RAY_CLUSTER,
    container_image=cpu_image,
    **cached(cache_version(AsyncConfig, RolloutConfig, DataConfig, RewardConfig, AlgoConfig, TrainConfig, HooksConfig, PublishConfig, module=__name__)),
    **declared("async", SMALL),  # the job's submitter pod; the head and worker groups have their own (RAY_CLUSTER)
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
    batches = {"scored": True, "reward_range": (reward.min, reward.max), "vocab_size": vocab_size(policy.dir.path), "group_size": rollout.n_samples}
    waiting = read_batch(buffer.path, **batches) if buffer is not None else []
    spec = PhaseSpec(
        cfg=cfg,
        rollout=rollout,
        reward=reward,
        algo=algo,
        train=train,
        hooks=hooks,
        source_fn=plugin(data, "data", "source_fn"),
        seed=data.seed,
        prompts=load_prompts(dataset.train.path, data.input_key, data.label_key, data.metadata_key),
        state=state,
        waiting=[waiting[i : i + rollout.n_samples] for i in range(0, len(waiting), rollout.n_samples)],
        ckpt_dir=ckpt.dir.path,
        policy_dir=policy.dir.path,
        version=policy.version,
        reference_dir=reference.dir.path,
        first_iteration=first_iteration,
        steps=steps,
    )
    out = artifact_path(
        root,
        "async",
        first_iteration,
        cfg,
        rollout,
        reward,
        algo,
        train,
        hooks,
        publish_cfg,
        ckpt.dir.path,
        policy.dir.path,
        state,
        buffer.path if buffer is not None else "",
        steps,
        code,
    )
    with atomic_dir(out) as tmp:
        result = run_phase_into(spec, tmp, publish_cfg.dtype, batches)
    version = policy.version + steps
    print(
        f"async phase: steps {first_iteration + 1}-{first_iteration + steps}, {result.metrics['async/samples_per_s']:.1f} samples/s, "
        f"staleness mean {result.metrics['async/phase_staleness_mean']:.2f}, policy v{version}"
    )
    return AsyncPhaseResult(
        ckpt=Checkpoint(dir=lasting_dir(out / "checkpoint"), step=int(result.metrics["train/step"])),
        policy=Policy(dir=lasting_dir(out / "policy"), version=version),
        batches=lasting_dir(out / "batches"),
        buffer=lasting_file(out / "buffer.parquet") if result.buffer else None,
        state=result.state,
        dropped=result.dropped,
        steps=result.steps,
        metrics=result.metrics,
    )
