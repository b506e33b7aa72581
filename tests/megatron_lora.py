"""The LoRA run of tests/megatron_worker.py (`torchrun --nproc_per_node 2 ... lora ROOT`), read by
tests/integration/test_megatron_lora.py.

Rank 0 builds the tiny Qwen2 policy in ROOT/hf, both ranks convert it to ROOT/mg.  Then at TP 1 (data parallel 2)
and at TP 2 (sequence parallel): two GRPO steps with adapters from the converted policy; the base weights before and
after, what the optimizer holds, the checkpoint's model tensors, and the adapter exported by the trainer and read back
from its checkpoint (ROOT/adapter-<run>[-checkpoint].safetensors).  At TP 1 also the log-probs of PEFT's model with that
adapter on the HF policy against megatron's, PEFT's merged weights against the trainer's, and the run saved after its
first step and resumed (from its adapters-only checkpoint and the HF base) against its second step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from miles_core.config import LoraConfig, ModelConfig
from miles_core.models.tiny import build_tiny_model
from miles_core.step import optimize
from miles_core.train.base import pack
from tests.megatron_worker import FNS, TINY, batch_loss, samples, train_cfg

LORA = LoraConfig(rank=4, alpha=8.0)


def _peft_model(hf_dir: Path, adapter: dict[str, torch.Tensor]):
    """The HF policy with the adapter applied by PEFT."""
    import peft

    from miles_core.models.loading import load_causal_lm

    model = peft.get_peft_model(load_causal_lm(str(hf_dir), torch.float32), peft.LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules="all-linear"))
    assert not peft.set_peft_model_state_dict(model, adapter).unexpected_keys
    return model.eval()


def _logprobs(model) -> torch.Tensor:
    """[B, T] response log-probs of an HF model on the fixed batch."""
    batch = pack(samples(), 0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]  # [B, L-1, V]
    next_tokens = torch.log_softmax(logits.float(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]  # [B, L-1]
    return next_tokens.gather(1, batch.gather_index) * batch.response_mask


def _peft_gaps(hf_dir: Path, adapter: dict[str, torch.Tensor], logprobs: torch.Tensor, merged: dict[str, torch.Tensor]) -> dict:
    """PEFT's log-probs against megatron's, and PEFT's merged weights against the trainer's (hf_state_dict)."""
    model = _peft_model(hf_dir, adapter)
    gaps = {"peft_gap": float((_logprobs(model) - logprobs).abs().max())}
    theirs = model.merge_and_unload().state_dict()
    return gaps | {"merged_gap": max(float((theirs[k] - t).abs().max()) for k, t in merged.items())}


def _optimizer_holds_adapters_only(trainer) -> bool:
    """The elements the distributed optimizer steps (its data-parallel shards together) are this rank's adapters', on every rank."""
    from megatron.core import parallel_state

    from miles_core.checkpoint.lora_map import is_adapter

    stepped = torch.tensor(sum(p.numel() for p in trainer.optimizer.get_parameters()))
    dist.all_reduce(stepped, group=parallel_state.get_data_parallel_group())
    adapters = sum(p.numel() for name, p in trainer.ddp.module.named_parameters() if is_adapter(name))
    agreed = torch.tensor(int(stepped) == adapters)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed)


def _held_tensors(ckpt: Path) -> list[str]:
    from megatron.core import dist_checkpointing

    return sorted(k for k in dist_checkpointing.load_tensors_metadata(str(ckpt / "model")) if not k.startswith("optimizer"))


def _refusals(ckpt: str, cfg, spec) -> list[str]:
    """The errors of an adapters-only checkpoint loaded without its base, or at another rank, and of adapters on an MoE
    model (a user's checkpoint, which the rules table cannot see)."""
    from miles_core.config import ConfigError
    from miles_core.train.megatron.model import Parallel, build_model
    from miles_core.train.megatron.trainer import MegatronTrainer

    attempts = [
        lambda: MegatronTrainer.load(ckpt, cfg),
        lambda: MegatronTrainer.load(ckpt, dataclasses.replace(cfg, lora=dataclasses.replace(LORA, rank=8)), "base"),
        lambda: build_model(dataclasses.replace(spec, num_experts=4), Parallel(), lora=LORA),
    ]
    errors = []
    for attempt in attempts:
        try:
            attempt()
        except (ConfigError, ValueError) as err:
            errors.append(str(err))
    return errors


def _train(root: Path, tp: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """Two steps with adapters from the converted policy at this TP (data parallel: the rest of the world of 2)."""
    from miles_core.checkpoint import torch_dist
    from miles_core.train.megatron.trainer import MegatronTrainer

    run, cfg = root / f"lora-tp{tp}", dataclasses.replace(train_cfg(tp, world=2), lora=LORA)
    trainer = MegatronTrainer.load(str(root / "mg"), cfg)
    base = torch_dist.gather_full_state(trainer.ddp.module, trainer.spec)
    result = {"loss_before": batch_loss(trainer), "train_losses": [optimize(trainer, samples(), FNS, 0)["train/loss"]]}
    trainer.save(f"{run}-first")
    result["train_losses"].append(optimize(trainer, samples(), FNS, 0)["train/loss"])
    trainer.save(str(run))
    result |= {
        "loss_after": batch_loss(trainer),
        "base_unchanged": all(torch.equal(t, base[k]) for k, t in torch_dist.gather_full_state(trainer.ddp.module, trainer.spec).items()),
        "optimizer_holds_adapters_only": _optimizer_holds_adapters_only(trainer),
    }
    adapter = trainer.adapter_state_dict()
    if tp == 1:
        resumed = MegatronTrainer.load(f"{run}-first", cfg, str(root / "hf"))
        optimize(resumed, samples(), FNS, 0)
        result |= {"resumed": batch_loss(resumed), "resumed_adapter_equal": all(torch.equal(t, adapter[k]) for k, t in resumed.adapter_state_dict().items())}
        result["refusals"] = _refusals(f"{run}-first", cfg, trainer.spec)
        batch = pack(samples(), 0)
        logprobs, merged = trainer.logprobs(batch, 1.0) * batch.response_mask, trainer.hf_state_dict()
        if dist.get_rank() == 0:
            result |= _peft_gaps(root / "hf", adapter, logprobs, merged)
    return result, adapter


def lora(root: Path) -> dict:
    from miles_core.checkpoint import torch_dist
    from miles_core.train.megatron.model import Parallel, init_parallel

    init_parallel(Parallel(), seed=0)
    if dist.get_rank() == 0:
        build_tiny_model(ModelConfig(arch="qwen2", **TINY), root / "hf")
    dist.barrier()
    torch_dist.hf_to_torch_dist(root / "hf", root / "mg")
    runs = {f"tp{tp}": _train(root, tp) for tp in (1, 2)}
    result = {"rank": dist.get_rank()}
    for name, (trained, adapter) in runs.items():
        from_checkpoint = torch_dist.TorchDistCheckpoint(root / f"lora-{name}").adapter_state_dict()  # re-forms the groups at TP 1
        if dist.get_rank() == 0:
            save_file(adapter, str(root / f"adapter-{name}.safetensors"))
            save_file(from_checkpoint, str(root / f"adapter-{name}-checkpoint.safetensors"))
            result[name] = trained | {"held_tensors": _held_tensors(root / f"lora-{name}")}
    return result
