"""The megatron backend's tasks: convert (HF -> torch_dist), train (distributed), publish (-> HF).

Each runs as a kfpytorch `Elastic` task: its workers are fresh processes (torchrun semantics,
one per GPU on a cluster; locally `start_method="fork"`, gloo on CPU), so megatron's process
groups never live in the workflow's own process.  Elastic returns rank 0's value.  Signatures
match tasks.rl's convert/train/publish, so the loop only chooses which to call.
"""

from __future__ import annotations

import torch
from flytekit import Resources, task
from flytekitplugins.kfpytorch import Elastic
from transformers import AutoTokenizer

from containers.images import cpu_image
from miles_core.checkpoint.torch_dist import TorchDistCheckpoint, hf_to_torch_dist
from miles_core.config import AlgoConfig, HooksConfig, PublishConfig, RewardConfig, RolloutConfig, TrainConfig
from miles_core.plugins import plugin
from miles_core.schemas import read_batch
from miles_core.storage import artifact_path, atomic_dir
from miles_core.train.megatron.trainer import MegatronTrainer
from miles_core.weights.publish import copy_tokenizer, publish as publish_policy
from tasks.common import BatchResult, Checkpoint, Policy, TrainResult, cache_version, lasting_dir, load_critic, new_critic, rl_step

ONE_PROCESS = Elastic(nnodes=1, nproc_per_node=1, start_method="fork")
LOCAL_RESOURCES = Resources(cpu="2", mem="8Gi")


def _forked_worker() -> None:
    # the worker is forked from a process whose OpenMP thread team already ran (libgomp is not fork-safe):
    # a new team would deadlock, so the worker computes on its one thread (one process per core here)
    torch.set_num_threads(1)


def distributed(train: TrainConfig) -> Elastic:
    return Elastic(nnodes=1, nproc_per_node=train.nproc_per_node, start_method="fork")


def train_overrides(train: TrainConfig) -> dict:
    """What the recipe decides about the train task's pods: processes per node and, on GPU nodes, GPUs."""
    overrides = {"task_config": distributed(train)}
    if train.gpus_per_node:
        gpus = Resources(cpu=str(8 * train.gpus_per_node), mem=f"{64 * train.gpus_per_node}Gi", gpu=str(train.gpus_per_node))
        overrides.update(requests=gpus, limits=gpus)
    return overrides


@task(cache=True, cache_version=cache_version(TrainConfig, AlgoConfig), container_image=cpu_image, task_config=ONE_PROCESS, requests=LOCAL_RESOURCES)
def convert(cfg: TrainConfig, algo: AlgoConfig, policy: Policy, root: str) -> Checkpoint:
    """Base HF checkpoint -> Megatron torch_dist checkpoint (reshardable to any TP/PP/EP)."""
    _forked_worker()
    out = artifact_path(root, "checkpoint", 0, cfg, algo, policy.dir.path)
    with atomic_dir(out) as tmp:
        hf_to_torch_dist(policy.dir.path, tmp, cfg.seed)
        new_critic(algo, cfg, policy.dir.path, tmp)
        copy_tokenizer(policy.dir.path, tmp)
    return Checkpoint(dir=lasting_dir(out), step=0)


@task(cache=True, cache_version=cache_version(AlgoConfig, TrainConfig, RolloutConfig, HooksConfig), container_image=cpu_image,
      task_config=Elastic(nnodes=1, nproc_per_node=2, start_method="fork"), requests=LOCAL_RESOURCES)
def train(algo: AlgoConfig, cfg: TrainConfig, reward: RewardConfig, rollout: RolloutConfig, hooks: HooksConfig,
          ckpt: Checkpoint, batch: BatchResult, reference: Policy, iteration: int, root: str) -> TrainResult:
    """One RL step on every rank (each trains its data-parallel rows); rank 0's result is the task's."""
    _forked_worker()
    samples = read_batch(batch.batch.path, scored=True, reward_range=(reward.min, reward.max))
    trainer = MegatronTrainer.load(ckpt.dir.path, cfg)
    ref = MegatronTrainer.from_hf(reference.dir.path, cfg) if algo.kl_coef > 0 else None
    critic = load_critic(algo, cfg, ckpt.dir.path)  # a replica per rank: each trains it on the whole batch alike
    pad_id = AutoTokenizer.from_pretrained(ckpt.dir.path).pad_token_id
    metrics = rl_step(trainer, samples, algo, rollout, hooks, pad_id, ref, critic, iteration)
    out = artifact_path(root, "checkpoint", iteration + 1, algo, cfg, rollout, hooks, ckpt.dir.path, batch.batch.path)
    trainer.save_atomically(out, ckpt.dir.path, also=(lambda tmp: critic.save(str(tmp / "critic"))) if critic else None)
    plugin(hooks, "hooks", "after_save")(str(out), iteration)
    return TrainResult(ckpt=Checkpoint(dir=lasting_dir(out), step=trainer.step), metrics=metrics)


@task(cache=True, cache_version=cache_version(PublishConfig, TrainConfig), container_image=cpu_image, task_config=ONE_PROCESS, requests=LOCAL_RESOURCES)
def publish(cfg: PublishConfig, train_cfg: TrainConfig, ckpt: Checkpoint, parent: Policy, root: str) -> Policy:
    """Megatron checkpoint (any parallel sizes) -> HF safetensors + lineage manifest, the next policy version."""
    _forked_worker()
    version = parent.version + 1
    out = artifact_path(root, "policy", version, cfg, ckpt.dir.path)
    publish_policy(TorchDistCheckpoint(ckpt.dir.path), ckpt.dir.path, out, cfg.dtype, version, parent.version)
    return Policy(dir=lasting_dir(out), version=version)
