"""The tasks of one RL iteration: convert (once), rollout, score, train, publish, evaluate.

Each unpacks its typed inputs, calls one function of miles_core and returns typed outputs that
point at artifacts under the run root.
"""

from __future__ import annotations

from flytekit import task
from transformers import AutoTokenizer

from containers.images import cpu_image
from miles_core import loop
from miles_core.config import AlgoConfig, DataConfig, EvalConfig, PublishConfig, RewardConfig, RolloutConfig, TrainConfig
from miles_core.data.source import DataState, PromptSource, load_prompts
from miles_core.plugins import load_function
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.schemas import read_batch, write_batch
from miles_core.storage import artifact_path, atomic_dir
from miles_core.train.torch_backend import TorchTrainer
from miles_core.weights.publish import copy_tokenizer, publish as publish_policy
from tasks.common import BatchResult, Checkpoint, Dataset, Policy, RolloutResult, TrainResult, cache_version, lasting_dir, lasting_file

REWARD_PARAMS = ("response", "label", "metadata")


def _prompts(dataset_file, data: DataConfig):
    return load_prompts(dataset_file.path, data.input_key, data.label_key, data.metadata_key)


@task(cache=True, cache_version=cache_version(TrainConfig), container_image=cpu_image)
def convert(cfg: TrainConfig, policy: Policy, root: str) -> Checkpoint:
    """Base HF checkpoint -> the trainer's checkpoint format."""
    out = artifact_path(root, "checkpoint", 0, cfg, policy.dir.path)
    with atomic_dir(out) as tmp:
        TorchTrainer.from_hf(policy.dir.path, cfg).save(str(tmp))
        copy_tokenizer(policy.dir.path, tmp)
    return Checkpoint(dir=lasting_dir(out), step=0)


@task(cache=True, cache_version=cache_version(RolloutConfig, DataConfig), container_image=cpu_image)
def rollout(cfg: RolloutConfig, data: DataConfig, policy: Policy, dataset: Dataset, state: DataState, iteration: int, root: str) -> RolloutResult:
    source = PromptSource(_prompts(dataset.train, data), seed=data.seed, state=state)
    prompts = source.next_batch(cfg.prompts_per_step)
    engine = TorchEngine(policy.dir.path, policy.version)
    samples, metrics = loop.rollout(engine, prompts, AutoTokenizer.from_pretrained(policy.dir.path), cfg, seed=cfg.seed * 1_000_003 + iteration)
    out = write_batch(samples, artifact_path(root, "rollout", iteration, cfg, policy.dir.path, state, suffix=".parquet"))
    return RolloutResult(batch=lasting_file(out), state=source.state, metrics=metrics)


@task(cache=True, cache_version=cache_version(RewardConfig), container_image=cpu_image)
def score(cfg: RewardConfig, group_size: int, policy: Policy, batch: RolloutResult, iteration: int, root: str) -> BatchResult:
    samples = read_batch(batch.batch.path)
    reward_fn = load_function(cfg.fn, "reward.fn", REWARD_PARAMS)
    metrics = loop.score(samples, reward_fn, AutoTokenizer.from_pretrained(policy.dir.path), cfg, group_size)
    out = artifact_path(root, "scored", iteration, cfg, batch.batch.path, suffix=".parquet")
    write_batch(samples, out, scored=True, reward_range=(cfg.min, cfg.max))
    return BatchResult(batch=lasting_file(out), metrics=metrics)


@task(cache=True, cache_version=cache_version(AlgoConfig, TrainConfig), container_image=cpu_image)
def train(algo: AlgoConfig, cfg: TrainConfig, reward: RewardConfig, group_size: int, temperature: float, ckpt: Checkpoint, batch: BatchResult, reference: Policy, iteration: int, root: str) -> TrainResult:
    samples = read_batch(batch.batch.path, scored=True, reward_range=(reward.min, reward.max))
    trainer = TorchTrainer.load(ckpt.dir.path, cfg)
    ref = TorchTrainer.from_hf(reference.dir.path, cfg) if algo.kl_coef > 0 else None
    pad_id = AutoTokenizer.from_pretrained(ckpt.dir.path).pad_token_id
    metrics = loop.train(trainer, samples, algo, group_size, temperature, pad_id, reference=ref)
    out = artifact_path(root, "checkpoint", iteration + 1, algo, cfg, ckpt.dir.path, batch.batch.path)
    with atomic_dir(out) as tmp:
        trainer.save(str(tmp))
        copy_tokenizer(ckpt.dir.path, tmp)
    return TrainResult(ckpt=Checkpoint(dir=lasting_dir(out), step=trainer.step), metrics=metrics)


@task(cache=True, cache_version=cache_version(PublishConfig, TrainConfig), container_image=cpu_image)
def publish(cfg: PublishConfig, train_cfg: TrainConfig, ckpt: Checkpoint, parent: Policy, root: str) -> Policy:
    """Export the checkpoint as the next policy version (HF safetensors + lineage manifest)."""
    version = parent.version + 1
    out = artifact_path(root, "policy", version, cfg, ckpt.dir.path)
    publish_policy(TorchTrainer.load(ckpt.dir.path, train_cfg), ckpt.dir.path, out, cfg.dtype, version, parent.version)
    return Policy(dir=lasting_dir(out), version=version)


@task(cache=True, cache_version=cache_version(EvalConfig, RewardConfig, DataConfig), container_image=cpu_image)
def evaluate(cfg: EvalConfig, reward: RewardConfig, data: DataConfig, policy: Policy, dataset: Dataset) -> dict[str, float]:
    """Greedy accuracy of a policy version on the held-out split."""
    reward_fn = load_function(reward.fn, "reward.fn", REWARD_PARAMS)
    engine = TorchEngine(policy.dir.path, policy.version, max_batch_sequences=cfg.batch_size)
    tokenizer = AutoTokenizer.from_pretrained(policy.dir.path)
    metrics = loop.evaluate(engine, _prompts(dataset.test, data), tokenizer, reward_fn, reward, cfg)
    print(f"evaluate: policy v{policy.version}: held-out accuracy {metrics['eval/accuracy']:.3f}")
    return metrics
