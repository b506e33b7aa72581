"""The tasks of one RL iteration: convert (once), rollout, score, train, publish, evaluate.

Each unpacks its typed inputs, calls one function of miles_core and returns typed outputs that
point at artifacts under the run root.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from flytekit import task
from flytekit.types.file import FlyteFile
from transformers import AutoTokenizer

from containers.images import cpu_image
from miles_core import loop
from miles_core.config import AlgoConfig, DataConfig, EvalConfig, HooksConfig, PublishConfig, RewardConfig, RolloutConfig, TrainConfig
from miles_core.data.source import DataState, load_prompts
from miles_core.plugins import plugin
from miles_core.rollout.engines import make_engine, weight_update_metrics
from miles_core.schemas import read_batch, write_batch
from miles_core.storage import artifact_path, atomic_dir
from miles_core.train.torch_backend import TorchTrainer
from miles_core.weights.publish import copy_tokenizer, publish as publish_policy
from tasks.common import BatchResult, load_critic, new_critic, rl_step, Checkpoint, Dataset, Policy, RolloutResult, TrainResult, cache_version, lasting_dir, lasting_file


def _prompts(dataset_file, data: DataConfig):
    return load_prompts(dataset_file.path, data.input_key, data.label_key, data.metadata_key)


def _scorer(reward: RewardConfig, tokenizer, group_size: int):
    return functools.partial(loop.score, reward_fn=loop.reward_fn_of(reward), tokenizer=tokenizer, cfg=reward, group_size=group_size)


@task(cache=True, cache_version=cache_version(TrainConfig, AlgoConfig), container_image=cpu_image)
def convert(cfg: TrainConfig, algo: AlgoConfig, policy: Policy, root: str) -> Checkpoint:
    """Base HF checkpoint -> the trainer's checkpoint format (and a fresh critic for PPO)."""
    out = artifact_path(root, "checkpoint", 0, cfg, algo, policy.dir.path)
    with atomic_dir(out) as tmp:
        TorchTrainer.from_hf(policy.dir.path, cfg).save(str(tmp))
        new_critic(algo, cfg, policy.dir.path, tmp)
        copy_tokenizer(policy.dir.path, tmp)
    return Checkpoint(dir=lasting_dir(out), step=0)


@task(cache=True, cache_version=cache_version(RolloutConfig, DataConfig, RewardConfig), container_image=cpu_image)
def rollout(cfg: RolloutConfig, data: DataConfig, reward: RewardConfig, policy: Policy, dataset: Dataset, state: DataState,
            buffer: Optional[FlyteFile], iteration: int, root: str) -> RolloutResult:
    source = plugin(data, "data", "source_fn")(_prompts(dataset.train, data), data.seed, state)
    tokenizer = AutoTokenizer.from_pretrained(policy.dir.path)
    waiting = read_batch(buffer.path, scored=True) if buffer is not None else []
    groups = [waiting[i : i + cfg.n_samples] for i in range(0, len(waiting), cfg.n_samples)]
    engine = make_engine(cfg, policy.dir.path, policy.version)
    samples, left, metrics = plugin(cfg, "rollout", "rollout_fn")(
        engine, source, tokenizer, cfg, _scorer(reward, tokenizer, cfg.n_samples), groups, cfg.seed * 1_000_003 + iteration,
    )
    metrics.update(weight_update_metrics(engine))
    out = artifact_path(root, "rollout", iteration, cfg, reward, policy.dir.path, state, buffer.path if buffer else "", suffix=".parquet")
    write_batch(samples, out)
    left_file = write_batch([s for g in left for s in g], out.with_suffix(".buffer.parquet"), scored=True) if left else None
    return RolloutResult(batch=lasting_file(out), state=source.state, metrics=metrics, buffer=lasting_file(left_file) if left_file else None)


@task(cache=True, cache_version=cache_version(RewardConfig, HooksConfig), container_image=cpu_image)
def score(cfg: RewardConfig, hooks: HooksConfig, group_size: int, policy: Policy, batch: RolloutResult, iteration: int, root: str) -> BatchResult:
    samples = read_batch(batch.batch.path)
    metrics = _scorer(cfg, AutoTokenizer.from_pretrained(policy.dir.path), group_size)(samples)
    metrics.update(plugin(hooks, "hooks", "rollout_log")(samples, {**batch.metrics, **metrics}, iteration))
    out = artifact_path(root, "scored", iteration, cfg, hooks, batch.batch.path, suffix=".parquet")
    write_batch(samples, out, scored=True, reward_range=(cfg.min, cfg.max))
    return BatchResult(batch=lasting_file(out), metrics=metrics)


@task(cache=True, cache_version=cache_version(AlgoConfig, TrainConfig, RolloutConfig, HooksConfig), container_image=cpu_image)
def train(algo: AlgoConfig, cfg: TrainConfig, reward: RewardConfig, rollout: RolloutConfig, hooks: HooksConfig,
          ckpt: Checkpoint, batch: BatchResult, reference: Policy, iteration: int, root: str) -> TrainResult:
    samples = read_batch(batch.batch.path, scored=True, reward_range=(reward.min, reward.max))
    trainer = TorchTrainer.load(ckpt.dir.path, cfg)
    critic = load_critic(algo, cfg, ckpt.dir.path)
    ref = TorchTrainer.from_hf(reference.dir.path, cfg) if algo.kl_coef > 0 else None
    pad_id = AutoTokenizer.from_pretrained(ckpt.dir.path).pad_token_id
    metrics = rl_step(trainer, samples, algo, rollout, hooks, pad_id, ref, critic, iteration)
    out = artifact_path(root, "checkpoint", iteration + 1, algo, cfg, rollout, hooks, ckpt.dir.path, batch.batch.path)
    with atomic_dir(out) as tmp:
        trainer.save(str(tmp))
        if critic is not None:
            critic.save(str(tmp / "critic"))
        copy_tokenizer(ckpt.dir.path, tmp)
    plugin(hooks, "hooks", "after_save")(str(out), iteration)
    return TrainResult(ckpt=Checkpoint(dir=lasting_dir(out), step=trainer.step), metrics=metrics)


@task(cache=True, cache_version=cache_version(PublishConfig, TrainConfig), container_image=cpu_image)
def publish(cfg: PublishConfig, train_cfg: TrainConfig, ckpt: Checkpoint, parent: Policy, root: str) -> Policy:
    """Export the checkpoint as the next policy version (HF safetensors + lineage manifest)."""
    version = parent.version + 1
    out = artifact_path(root, "policy", version, cfg, ckpt.dir.path)
    publish_policy(TorchTrainer.load(ckpt.dir.path, train_cfg), ckpt.dir.path, out, cfg.dtype, version, parent.version)
    return Policy(dir=lasting_dir(out), version=version)


@task(cache=True, cache_version=cache_version(EvalConfig, RewardConfig, DataConfig, RolloutConfig), container_image=cpu_image)
def evaluate(cfg: EvalConfig, reward: RewardConfig, data: DataConfig, rollout: RolloutConfig, policy: Policy, dataset: Dataset) -> dict[str, float]:
    """Held-out evaluation of a policy version (evaluation.fn, greedy accuracy by default)."""
    engine = make_engine(rollout, policy.dir.path, policy.version, max_batch_sequences=cfg.batch_size)
    tokenizer = AutoTokenizer.from_pretrained(policy.dir.path)
    metrics = plugin(cfg, "evaluation", "fn")(
        engine, _prompts(dataset.test, data), tokenizer, loop.reward_fn_of(reward), reward, cfg, generate_fn=loop.generate_fn_of(rollout),
    )
    print(f"evaluate: policy v{policy.version}: held-out accuracy {metrics['eval/accuracy']:.3f}")
    return metrics
