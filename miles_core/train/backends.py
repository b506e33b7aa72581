"""The trainer backends behind one factory: `train.backend` picks torch or megatron-core.

Everything a task or an actor does with a trainer goes through here: build it from an HF
checkpoint (`make_trainer`), convert an HF checkpoint into the backend's own format
(`convert_checkpoint`), load that format (`load_trainer`), export it as the next policy
(`export_policy`), and PPO's critic beside it (`new_critic`, `load_critic`). The critic is a torch
model whichever backend trains the policy; on megatron every rank holds a replica and trains it
on the whole batch alike.

Each backend's module is imported only when it is asked for (`trainer_class`): megatron-core is an optional library, and the
torch backend brings transformers' model classes, which a task that trains nothing need not load.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import torch

from miles_core.config import AlgoConfig, LoraConfig, PublishConfig, TrainConfig
from miles_core.models.tokenizers import load_tokenizer
from miles_core.samples import Sample
from miles_core.step import StepFns, train_step
from miles_core.train.base import Trainer
from miles_core.weights.check import check_hf_dir
from miles_core.weights.publish import HfCheckpoint, copy_tokenizer, publish


def trainer_class(cfg: TrainConfig) -> type[Trainer]:
    """The trainer class of `cfg.backend`, imported where used: megatron-core is optional, and the torch backend loads
    transformers' model classes, seconds of the start-up of a task that imports this module and trains nothing."""
    if cfg.backend == "megatron":
        from miles_core.train.megatron.trainer import MegatronTrainer

        return MegatronTrainer
    from miles_core.train.torch_backend import TorchTrainer

    return TorchTrainer


def _critic() -> type[Trainer]:
    """PPO's critic, a torch model whichever backend trains the policy (imported where used, as `trainer_class`)."""
    from miles_core.train.torch_backend import TorchCritic

    return TorchCritic


def preload(cfg: TrainConfig) -> None:
    """Loads what a worker of the backend imports, in the process its workers fork from (tasks/elastic.py): megatron-core
    and its CPU redirections, which every forked worker would otherwise import again (seconds each on a CPU: its import
    sets up torch.compile for its fused kernels). Only with a CPU build of torch: a CUDA build's agent leaves megatron's
    imports, and any CUDA set-up they may do, to its workers, since CUDA does not survive a fork."""
    if cfg.backend == "megatron" and not torch.backends.cuda.is_built():
        from miles_core.train.megatron import cpu_compat, trainer  # noqa: F401 (imported for the workers)

        cpu_compat.activate()


def make_trainer(cfg: TrainConfig, policy_dir: str) -> Trainer:
    """A fresh trainer (no optimizer state) on an HF checkpoint (checked first): the KL reference, the start policy as it
    is, so without LoRA adapters or a draft head whatever train says."""
    check_hf_dir(policy_dir)
    return trainer_class(cfg).from_hf(policy_dir, dataclasses.replace(cfg, lora=LoraConfig(), mtp_lr=0.0))


def load_trainer(cfg: TrainConfig, ckpt_dir: str, base_dir: str | None = None) -> Trainer:
    """A trainer resumed from the backend's checkpoint (model, optimizer, RNG, step); with train.lora the checkpoint
    holds the adapter alone, loaded onto the base model of base_dir (the reference policy)."""
    return trainer_class(cfg).load(ckpt_dir, cfg, base_dir)


def convert_checkpoint(cfg: TrainConfig, algo: AlgoConfig, policy_dir: str, out_dir: Path) -> None:
    """HF checkpoint -> the backend's checkpoint in out_dir (with a fresh critic for PPO, and the tokenizer).
    The HF directory is checked before any compute: a malformed one fails naming its file and key or tensor."""
    check_hf_dir(policy_dir)
    if cfg.backend == "megatron":
        from miles_core.checkpoint.torch_dist import hf_to_torch_dist  # optional backend: imported where used

        hf_to_torch_dist(policy_dir, out_dir, cfg.seed)
    else:
        trainer_class(cfg).from_hf(policy_dir, cfg, device="cpu").save(str(out_dir))
    new_critic(algo, cfg, policy_dir, out_dir)
    copy_tokenizer(policy_dir, out_dir)


def export_policy(
    cfg: TrainConfig,
    ckpt_dir: str,
    out_dir: Path,
    publish_cfg: PublishConfig,
    version: int,
    parent_version: int | None,
    source: str | None = None,
    base_dir: str | None = None,
) -> dict:
    """The checkpoint's policy as an HF safetensors directory (publish_cfg's dtype and quantization), or with train.lora
    its adapter alone for the base model of base_dir, with its lineage manifest (naming `source`, else ckpt_dir);
    returns the manifest."""
    if cfg.backend == "megatron":
        from miles_core.checkpoint.torch_dist import TorchDistCheckpoint  # optional backend: imported where used

        trainer = TorchDistCheckpoint(ckpt_dir)
    elif cfg.lora.rank:
        trainer = trainer_class(cfg).load(ckpt_dir, cfg, base_dir, device="cpu", weights_only=True)
    else:
        trainer = HfCheckpoint(ckpt_dir)
    adapter = (cfg.lora, base_dir) if cfg.lora.rank else None
    return publish(trainer, ckpt_dir, out_dir, publish_cfg.dtype, version, parent_version, source, publish_cfg.fmt, adapter)


def save_checkpoint(trainer: Trainer, critic: Trainer | None, out_dir: Path, tokenizer_dir: str) -> None:
    """The trainer's checkpoint (and the critic beside it) written atomically to out_dir, with the tokenizer."""
    also = (lambda tmp: critic.save(str(Path(tmp) / "critic"))) if critic is not None else None
    trainer.save_atomically(out_dir, tokenizer_dir, also=also)


def train_checkpoint(
    cfg: TrainConfig,
    fns: StepFns,
    ckpt_dir: str,
    samples: list[Sample],
    reference_dir: str,
    out_dir: Path,
    iteration: int,
    trace: dict | None = None,
) -> tuple[int, dict[str, float]]:
    """The train stage from a checkpoint to the next: load, `step.train_step`, save atomically to out_dir,
    the after_save hook. Returns (optimizer steps so far, metrics); `trace` receives the step's per-token tensors.

    Run by every process of the train task: each trains its data-parallel share of the batch.
    """
    trainer = _resumed("policy", ckpt_dir, cfg, lambda: load_trainer(cfg, ckpt_dir, reference_dir))
    critic = _resumed("critic", str(Path(ckpt_dir) / "critic"), _critic_cfg(fns.algo, cfg), lambda: load_critic(fns.algo, cfg, ckpt_dir))
    reference = make_trainer(cfg, reference_dir) if fns.algo.kl_coef > 0 else None
    metrics = train_step(trainer, samples, fns, load_tokenizer(ckpt_dir).pad_token_id, reference, critic, iteration, trace)
    save_checkpoint(trainer, critic, out_dir, ckpt_dir)
    _kept.update({"policy": (os.getpid(), trainer), "critic": (os.getpid(), critic)})
    fns.after_save(str(out_dir), iteration)
    return trainer.step, metrics


# role -> (pid, trainer): the train stage's trainers as they saved the last checkpoint, in the process that trained them
# (a local run's, or one pod's that trains on); taken by the next train stage of that process, put back once it saved
_kept: dict[str, tuple[int, Trainer | None]] = {}


def _resumed(role: str, ckpt_dir: str, cfg: TrainConfig, load: Callable[[], Trainer | None]) -> Trainer | None:
    """The trainer saved in ckpt_dir: the one this process kept continued in place where it can be (`Trainer.resume`:
    the same config and model), else `load()`."""
    pid, kept = _kept.pop(role, (None, None))
    return kept if pid == os.getpid() and kept is not None and kept.resume(ckpt_dir, cfg) else load()


def _critic_cfg(algo: AlgoConfig, cfg: TrainConfig) -> TrainConfig:
    return dataclasses.replace(cfg, lr=algo.critic_lr, qat="", qat_group_size=128, lora=LoraConfig())  # values are not rolled out: no QAT; a full model


def new_critic(algo: AlgoConfig, cfg: TrainConfig, policy_dir: str, ckpt_dir) -> None:
    """PPO: a fresh critic (the policy's transformer with a value head) saved beside a new checkpoint."""
    if algo.advantage == "ppo":
        _critic().from_hf(policy_dir, _critic_cfg(algo, cfg), device="cpu").save(str(Path(ckpt_dir) / "critic"))


def load_critic(algo: AlgoConfig, cfg: TrainConfig, ckpt_dir: str) -> Trainer | None:
    """The critic saved beside a checkpoint (PPO), else None."""
    return _critic().load(str(Path(ckpt_dir) / "critic"), _critic_cfg(algo, cfg)) if algo.advantage == "ppo" else None
