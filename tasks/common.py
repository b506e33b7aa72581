"""Typed values that flow between the tasks, and what every task shares (image, cache version).

Every directory or file a task returns lives under the run root and is returned with
`from_source`, so flytekit records its path instead of copying it to a temporary folder that a
later cache hit could no longer find.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import transformers
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

import miles_core
from miles_core import loop
from miles_core.config import AlgoConfig, HooksConfig, RolloutConfig, TrainConfig, config_hash
from miles_core.data.source import DataState
from miles_core.plugins import plugin
from miles_core.storage import digest
from miles_core.train.torch_backend import TorchCritic

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the project builds its own models; never reach a hub
transformers.utils.logging.disable_progress_bar()  # per-load bars drown the per-iteration lines


@dataclass
class Policy:
    """A published policy version: an HF safetensors directory."""

    dir: FlyteDirectory
    version: int


@dataclass
class Checkpoint:
    """A trainer checkpoint (model, optimizer, RNG, step) in the backend's own format."""

    dir: FlyteDirectory
    step: int


@dataclass
class Dataset:
    """Train and held-out prompt files, with the sha256 of the train file (the data hash)."""

    train: FlyteFile
    test: FlyteFile
    sha256: str


@dataclass
class RolloutResult:
    batch: FlyteFile
    state: DataState  # the data source's position after this batch
    metrics: dict[str, float]
    buffer: Optional[FlyteFile] = None  # groups generated beyond the batch, for the next step


@dataclass
class BatchResult:
    batch: FlyteFile
    metrics: dict[str, float]


@dataclass
class TrainResult:
    ckpt: Checkpoint
    metrics: dict[str, float]


@dataclass
class Tracking:
    uri: str
    run_id: str


def lasting_dir(path) -> FlyteDirectory:
    return FlyteDirectory.from_source(str(path))


def lasting_file(path) -> FlyteFile:
    return FlyteFile.from_source(str(path))


def cache_version(*sections: type) -> str:
    """Derived from the schema and defaults of the config sections a task reads, and the core's
    version: changing either invalidates that task's cache; the section values are inputs."""
    schema = [(s.__name__, [(f.name, str(f.type)) for f in fields(s)], config_hash(s())) for s in sections]
    return f"{miles_core.__version__}-{digest(schema)}"



@dataclass
class AsyncPhaseResult:
    """What an async phase of K training steps leaves for the next phase or sync iteration."""

    ckpt: Checkpoint  # the trainer's checkpoint after the phase, the torch trainer's format
    policy: Policy  # the same weights published as version start + K
    batches: FlyteDirectory  # step-NNNN.parquet: every consumed batch, scored, with weight and trainer versions
    buffer: Optional[FlyteFile]  # scored groups generated but not consumed, with their weight versions
    state: DataState  # the data source's position after every prompt this phase drew
    dropped: list[str]  # "draw/index" of the samples dropped as too stale
    steps: list[dict[str, float]]  # per training step: the training metrics and the async ones
    metrics: dict[str, float]  # the phase's totals: throughput, staleness distribution, idle times


def _critic_cfg(algo: AlgoConfig, cfg: TrainConfig) -> TrainConfig:
    return dataclasses.replace(cfg, lr=algo.critic_lr)


def new_critic(algo: AlgoConfig, cfg: TrainConfig, policy_dir: str, ckpt_dir) -> None:
    """PPO: a fresh critic (the policy's transformer with a value head) saved beside a new checkpoint.
    It is a torch model whichever backend trains the policy; on megatron every rank holds a replica."""
    if algo.advantage == "ppo":
        TorchCritic.from_hf(policy_dir, _critic_cfg(algo, cfg)).save(str(Path(ckpt_dir) / "critic"))


def load_critic(algo: AlgoConfig, cfg: TrainConfig, ckpt_dir: str) -> TorchCritic | None:
    """The critic saved beside a checkpoint (PPO), else None."""
    return TorchCritic.load(str(Path(ckpt_dir) / "critic"), _critic_cfg(algo, cfg)) if algo.advantage == "ppo" else None


def rl_step(trainer, samples, algo: AlgoConfig, rollout: RolloutConfig, hooks: HooksConfig, pad_id: int, reference, critic, iteration: int) -> dict[str, float]:
    """`loop.train` between the before/after train-step hooks, for either backend's trainer; PPO's
    critic trains alone for its warm-up iterations."""
    plugin(hooks, "hooks", "before_train_step")(trainer, samples, iteration)
    metrics = loop.train(
        trainer, samples, algo, rollout.n_samples, rollout.temperature, pad_id, reference=reference, critic=critic,
        horizon=rollout.max_new_tokens, train_policy=critic is None or iteration >= algo.critic_warmup_steps,
    )
    plugin(hooks, "hooks", "after_train_step")(trainer, metrics, iteration)
    return metrics
