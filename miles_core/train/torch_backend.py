"""The torch trainer backend: the HF model itself, AdamW, micro-batches and gradient clipping.

The embedded default: this module supplies the HF model's forward pass (the policy loaded by
`miles_core.models.loading.load_causal_lm`: any family, a multimodal checkpoint as its text model), the backward pass of a
mini-batch in micro-batches and the clipped AdamW step; the mini-batch loop is `TrainerBase`'s. A pass computes a
group's prompt once where the family allows it and that costs less (train/prefix.py), and the output head only at the
positions before response tokens.
It computes on the CPU, or with train.gpus_per_node on its process's GPU (`train_device`; convert and publish read and
write checkpoints on the CPU). Under a multi-process launcher it is data parallel over gloo (NCCL between GPUs): every process holds the whole model,
trains on its share of each mini-batch's rows, and the gradients are summed before the step (the
same arithmetic as DDP; every process then holds the same weights, and rank 0 writes). `TorchCritic` is the same trainer around a value model (the policy's
transformer with a scalar head, HF's *ForTokenClassification), for PPO; its `logprobs` are
the values V(s_t) of the state before each response token.  A checkpoint is a directory holding the model as HF safetensors
(`save_pretrained`), `optimizer.safetensors` (train/optimizer_state.py) and `trainer_state.json` (step, torch RNG state), so a
resumed run continues bitwise on CPU.  With train.lora the model carries PEFT's LoRA adapters: the base weights are
frozen, the optimizer holds the adapters (and train.lora.trainable), and a checkpoint holds the adapter alone
(weights/adapter.py) where it would hold the model; the base it applies to is the train task's reference policy.  The weights and AdamW state are fp32 whatever train.dtype says.  With
bfloat16 the passes compute with a bf16 copy of the weights, made once per optimizer step (`torch.func.functional_call`
puts it in the fp32 parameters' place), and each micro-batch's bf16 gradients are added into fp32 gradients of the
master weights, as mixed-precision trainers do (Megatron's bf16 with fp32 main params): activations and the residual
stream are bf16, RMSNorm and softmax statistics fp32 (HF's modules upcast), log-probs and entropy fp32 from the bf16
logits (algos/kl.py).  `torch.autocast` computes the same matrix products but re-casts every weight in every forward
and keeps the activations fp32 around them: on a 2-core CPU the bf16 GRPO step of bench/trainer.py took ~1.4x less
CPU time this way.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForTokenClassification

from miles_core.algos.kl import entropy_from_logits, token_logprobs
from miles_core.algos.losses import loss_weights
from miles_core.config import TrainConfig
from miles_core.models.loading import load_causal_lm
from miles_core.routing import RouterTaps
from miles_core.train import prefix
from miles_core.train.base import LossFn, PackedBatch, TrainerBase, WeightsFn
from miles_core.train.mtp import MtpTrainer
from miles_core.train.optimizer_state import OPTIMIZER, load_optimizer, save_optimizer
from miles_core.train.qat import fake_quantize_forward
from miles_core.weights.adapter import adapter_state, is_adapter_dir, load_adapter_state, with_adapters, write_adapter
from miles_core.weights.in_place import built_from, load_in_place

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A bf16 pass that will be differentiated runs HF's eager attention on the CPU up to this many tokens: PyTorch's CPU
# flash-attention backward in bf16 is slow on short sequences (torch 2.13, 2 cores, 8 heads of 64, forward + backward:
# 128 sequences of 32 tokens ~115 ms, 3x its fp32 kernel, against ~35 ms eager; 32 of 128 tokens ~130 against ~75 ms),
# while the eager product's cost grows with the square of the length (8 of 512 tokens: ~135 flash against ~330 ms).
_BF16_CPU_EAGER_ATTENTION_MAX_LEN = 256


def train_device(cfg: TrainConfig) -> str:
    """Where a trainer of `cfg` computes: its process's GPU (cuda:LOCAL_RANK, one process per GPU) when the recipe gives
    the train pods GPUs (train.gpus_per_node), else the CPU."""
    if not cfg.gpus_per_node:
        return "cpu"
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError(f"train.gpus_per_node is {cfg.gpus_per_node}, but this process sees no CUDA device (CUDA_VISIBLE_DEVICES={visible!r})")
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


def join_process_group(device: torch.device) -> None:
    """Under a multi-process launcher (torchrun, a kfpytorch Elastic task: WORLD_SIZE > 1), join its group: NCCL between
    GPUs, gloo between CPU processes."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def _data_parallel() -> tuple[int, int]:
    """(rank, world size) of the data-parallel processes: (0, 1) in a plain process."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _rows_of(rank: int, world: int, n: int) -> slice:
    per_rank = -(-n // world)
    return slice(min(rank * per_rank, n), min((rank + 1) * per_rank, n))


class TorchTrainer(TrainerBase):
    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, step: int = 0, device: str | None = None):
        # the model's and each pass's (None: `train_device`); batches arrive, and log-probs leave, on the CPU
        self.device = torch.device(device or train_device(cfg))
        join_process_group(self.device)
        self.model = with_adapters(model.float().to(self.device).train(), cfg.lora)
        self.cfg = cfg
        self.step = step
        if cfg.qat:  # the forward computes with the int4 weights the published policy holds (train/qat.py)
            fake_quantize_forward(self.model, cfg.qat_group_size)
        self.taps: RouterTaps | None = None  # built on the first batch that carries routing
        self.mtp: MtpTrainer | None = None  # the MTP draft head trained beside the policy (train.mtp_lr), attached by from_hf / load
        self.optimizer = self._new_optimizer()
        self._bf16_weights: dict[str, torch.Tensor] | None = None  # train.dtype bfloat16: the copy the passes compute with, made when first needed
        self.built_from: tuple[bytes | None, ...] | None = None  # the config files of a checkpoint `load` built it from (`resume`)
        self._attention = self.model.config._attn_implementation  # the model's own; a short bf16 pass on the CPU swaps in eager (_outputs)
        self._prefix_cost = prefix.PrefixCost.of(self.model)  # None: this model cannot take a group's prompt once (train/prefix.py)

    def _new_optimizer(self) -> torch.optim.Optimizer:
        trained = [p for p in self.model.parameters() if p.requires_grad]  # all but a frozen vision tower (load_causal_lm) or LoRA's base
        # fused: one kernel per tensor for the whole update (CPU and CUDA) where the for-each loop makes ~8 passes over memory
        return torch.optim.AdamW(trained, lr=self.cfg.lr, betas=(self.cfg.beta1, self.cfg.beta2), weight_decay=self.cfg.weight_decay, fused=True)

    @staticmethod
    def load_model(path: str) -> torch.nn.Module:
        """The policy of an HF directory (a multimodal checkpoint as its text model), in fp32."""
        return load_causal_lm(path, torch.float32)

    @classmethod
    def from_hf(cls, policy_dir: str, cfg: TrainConfig, device: str | None = None) -> TorchTrainer:
        torch.manual_seed(cfg.seed)
        trainer = cls(cls.load_model(policy_dir), cfg, device=device)
        trainer.mtp = MtpTrainer.for_policy(trainer.model, policy_dir, cfg)
        return trainer

    @classmethod
    def load(cls, ckpt_dir: str, cfg: TrainConfig, base_dir: str | None = None, device: str | None = None, weights_only: bool = False) -> TorchTrainer:
        """The trainer saved in ckpt_dir; a LoRA checkpoint's adapter goes onto the base model of base_dir. weights_only:
        its weights alone, to read (publishing): the optimizer state is not loaded, this process's RNG not restored."""
        state = json.loads((Path(ckpt_dir) / "trainer_state.json").read_text())
        if is_adapter_dir(ckpt_dir) != bool(cfg.lora.rank):
            raise ValueError(f"{ckpt_dir}: {'an adapter' if is_adapter_dir(ckpt_dir) else 'a full model'} checkpoint, and train.lora.rank is {cfg.lora.rank}")
        if cfg.lora.rank and base_dir is None:
            raise ValueError(f"{ckpt_dir}: a LoRA checkpoint holds the adapter alone: the base model's directory is needed to load it")
        trainer = cls(cls.load_model(base_dir if cfg.lora.rank else ckpt_dir), cfg, step=state["step"], device=device)
        if cfg.lora.rank:
            load_adapter_state(trainer.model, ckpt_dir)
        trainer.mtp = MtpTrainer.for_policy(trainer.model, ckpt_dir, cfg)
        if weights_only:
            return trainer
        trainer._restore(ckpt_dir)
        trainer.built_from = built_from(ckpt_dir)
        return trainer

    def _restore(self, ckpt_dir: str) -> None:
        """The optimizer state and this process's RNG state saved in ckpt_dir."""
        load_optimizer(self.optimizer, Path(ckpt_dir) / OPTIMIZER)  # a freshly converted checkpoint has none yet
        torch.set_rng_state(torch.load(Path(ckpt_dir) / "rng.pt", weights_only=True))

    def resume(self, ckpt_dir: str, cfg: TrainConfig) -> bool:
        """This trainer continued in place as the one `load` would build from ckpt_dir: the checkpoint's weights copied
        into the model built already (weights/in_place.py), a new optimizer with the saved state, the saved step, RNG and
        MTP head. For the main recipe's policy ~15 instead of ~70 ms, most of it building the model. False, nothing
        changed, where the checkpoint is not one this trainer can take so: another config, a model of other config files
        or tensors, or LoRA (its checkpoint holds the adapter alone)."""
        if cfg != self.cfg or cfg.lora.rank or self.built_from is None or self.built_from != built_from(ckpt_dir):
            return False
        step = json.loads((Path(ckpt_dir) / "trainer_state.json").read_text())["step"]
        if not load_in_place(self.model, ckpt_dir):
            return False
        self.model.zero_grad(set_to_none=True)
        self.model.train()
        self.optimizer, self.step, self._bf16_weights = self._new_optimizer(), step, None
        self.mtp = MtpTrainer.for_policy(self.model, ckpt_dir, cfg)
        self._restore(ckpt_dir)
        return True

    def save(self, ckpt_dir: str) -> None:
        if not self._is_writer():  # data-parallel replicas are identical: one process writes, none races it on the same files
            return
        if self.cfg.lora.rank:
            write_adapter(ckpt_dir, self.adapter_state_dict(), self.cfg.lora, torch.float32)
        else:
            self.model.save_pretrained(ckpt_dir, safe_serialization=True)
        if self.step:
            save_optimizer(self.optimizer, Path(ckpt_dir) / OPTIMIZER)
        torch.save(torch.get_rng_state(), Path(ckpt_dir) / "rng.pt")
        if self.mtp is not None:
            self.mtp.save(ckpt_dir)
        (Path(ckpt_dir) / "trainer_state.json").write_text(json.dumps({"step": self.step, "backend": "torch", "parallel": {"world_size": _data_parallel()[1]}}))

    def export_hf(self, out_dir: str, dtype: str) -> None:
        state = {k: v.detach().to(_DTYPES[dtype]) for k, v in self.model.state_dict().items()}
        self.model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        if self.mtp is not None:  # published with the policy: the engine drafts with it (rollout.speculative_tokens)
            self.mtp.export(out_dir)

    def train_on(
        self, batch: PackedBatch, extras: dict, loss_fn: LossFn, temperature: float, lr: float | None = None, weights_fn: WeightsFn = loss_weights
    ) -> dict[str, float]:
        """The policy's update (TrainerBase.train_on), then the draft head's step on the same batch, when it has one."""
        metrics = super().train_on(batch, extras, loss_fn, temperature, lr, weights_fn)
        if self.mtp is not None:
            metrics.update(self.mtp.train_on(self.model, batch.to(self.device)))
        return metrics

    def _forward(self, batch: PackedBatch, temperature: float, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [b, T] of the batch's response tokens, and their entropy [b, T] unless `entropy` is False (None then)."""
        with self._replaying(batch):
            response_logits = self._outputs(batch)  # [b, T, V]
        targets = batch.input_ids[:, 1:].gather(1, batch.gather_index)  # [b, T]
        logprobs = token_logprobs(response_logits, targets, temperature) * batch.response_mask
        if not entropy:
            return logprobs, None
        return logprobs, entropy_from_logits(response_logits / temperature) * batch.response_mask  # in the graph: entropy bonus

    def _outputs(self, batch: PackedBatch) -> torch.Tensor:
        """The model's outputs [b, T, V] before each response token: with a group's prompt computed once where that
        pays (train/prefix.py; not while R3 replays routing by position), with the fp32 weights or with their bf16 copy
        when train.dtype is bfloat16."""
        bf16 = self.cfg.dtype == "bfloat16"
        lay = prefix.layout(batch, self._prefix_cost if batch.routed_experts is None else None, torch.bfloat16 if bf16 else torch.float32)
        kept = self._bf16_kept(lay) if bf16 else self._kept(lambda inputs: self.model(**inputs), lay)
        return kept.flatten(0, 1)[lay.pick]

    def _bf16_kept(self, lay: prefix.Layout) -> torch.Tensor:
        """`_kept` computed with the bf16 copy of the weights (copied again after each optimizer step)."""
        if self._bf16_weights is None:
            self._bf16_weights = {name: p.detach().to(torch.bfloat16).requires_grad_(p.requires_grad) for name, p in self.model.named_parameters()}
        short = lay.inputs["input_ids"].shape[1] <= _BF16_CPU_EAGER_ATTENTION_MAX_LEN
        self.model.config._attn_implementation = "eager" if self.device.type == "cpu" and short and torch.is_grad_enabled() else self._attention
        try:
            return self._kept(lambda inputs: torch.func.functional_call(self.model, self._bf16_weights, (), inputs), lay)
        finally:
            self.model.config._attn_implementation = self._attention  # the model's own for every other user (the MTP head's pass)

    @staticmethod
    def _kept(run: Callable[[dict], Any], lay: prefix.Layout) -> torch.Tensor:
        """The model's outputs at the layout's kept positions [R, K, V]; `run` calls it on a dict of inputs."""
        return run({**lay.inputs, "logits_to_keep": lay.keep}).logits

    def _accumulate_bf16_grads(self) -> None:
        """Add the gradients of the bf16 copy into the fp32 parameters' (train.dtype bfloat16), micro-batch by
        micro-batch: summed in fp32, as the optimizer reads them."""
        for name, param in self.model.named_parameters():
            grad, self._bf16_weights[name].grad = self._bf16_weights[name].grad, None
            if grad is not None:
                param.grad = grad.float() if param.grad is None else param.grad.add_(grad)

    def _replaying(self, batch: PackedBatch):
        """The rollout's experts forced on the batch's positions where it carries routing (R3), else nothing."""
        if batch.routed_experts is None:
            return contextlib.nullcontext()
        if self.taps is None:
            self.taps = RouterTaps(self.model)
        return self.taps.replaying(batch.routed_experts)

    def routing_metrics(self) -> dict[str, float]:
        common, positions = self.taps.agreement if self.taps is not None else (0.0, 0.0)
        return {"routing/agreement": common / positions} if positions else {}

    @torch.no_grad()
    def logprobs(self, batch: PackedBatch, temperature: float) -> torch.Tensor:
        if self.taps is not None:
            self.taps.agreement = (0.0, 0.0)  # routing_metrics: of this pass
        step, batch = self.cfg.micro_batch_size, batch.to(self.device)
        return torch.cat([self._forward(batch.select(slice(i, i + step)), temperature, entropy=False)[0] for i in range(0, len(batch), step)]).cpu()

    def _backward(self, mini: PackedBatch, weights: torch.Tensor, extras: dict, loss_fn: LossFn, temperature: float) -> dict[str, float]:
        """This process's rows of the mini-batch in micro-batches; with several processes the gradients
        are summed over them (the weights already normalise over the whole mini-batch, so the sum is the
        mini-batch's gradient)."""
        rank, world = _data_parallel()
        rows = _rows_of(rank, world, len(mini))
        mini, weights, extras = mini.select(rows).to(self.device), weights[rows].to(self.device), {k: v[rows].to(self.device) for k, v in extras.items()}
        sums: dict[str, float] = {}
        for start in range(0, len(mini), self.cfg.micro_batch_size):
            micro_rows = slice(start, start + self.cfg.micro_batch_size)
            micro = mini.select(micro_rows)
            logprobs, entropy = self._forward(micro, temperature)
            loss, metrics = loss_fn(logprobs, entropy, micro.loss_mask, {k: v[micro_rows] for k, v in extras.items()})
            (loss * weights[micro_rows]).sum().backward()
            if self._bf16_weights is not None:
                self._accumulate_bf16_grads()
            if entropy is not None:
                metrics = {"entropy": entropy.detach(), **metrics}
            for name, values in {"loss": loss.detach(), **metrics}.items():
                sums[name] = sums.get(name, 0.0) + float((values * micro.loss_mask).sum())
        if world > 1:
            for param in (p for p in self.model.parameters() if p.requires_grad):
                if param.grad is None:  # a parameter this process's rows did not reach
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad)
        return sums

    def _totals(self, sums: dict, tokens: float) -> dict[str, float]:
        if _data_parallel()[1] > 1:
            names = sorted(sums)
            summed = torch.tensor([float(sums[k]) for k in names], dtype=torch.float64, device=self.device)
            dist.all_reduce(summed)
            sums = dict(zip(names, summed.tolist()))
        return super()._totals(sums, tokens)

    def _check_batch(self, batch: PackedBatch) -> None:
        world = _data_parallel()[1]
        if len(batch) // self.cfg.mini_batches < world:
            raise ValueError(f"a mini-batch of {len(batch) // self.cfg.mini_batches} samples cannot be split over {world} data-parallel processes")

    def _optimizer_step(self) -> float:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        self.optimizer.step()
        self._bf16_weights = None  # stale: the next pass copies the updated weights
        return grad_norm

    def _is_writer(self) -> bool:
        return _data_parallel()[0] == 0

    def _barrier(self) -> None:
        if _data_parallel()[1] > 1:
            dist.barrier()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter (and train.lora.trainable) under PEFT's key names (weights/adapter.py)."""
        return adapter_state(self.model)


class TorchCritic(TorchTrainer):
    @staticmethod
    def load_model(path: str) -> torch.nn.Module:
        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0  # HF's token classifier drops 10% before the head by default: V(s) would change from pass to pass
        return AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32)

    def _forward(self, batch: PackedBatch, temperature: float, entropy: bool = True) -> tuple[torch.Tensor, None]:  # a value has no entropy
        return self._outputs(batch)[..., 0] * batch.response_mask, None  # [b, T] V before each token

    @staticmethod
    def _kept(run: Callable[[dict], Any], lay: prefix.Layout) -> torch.Tensor:
        """A value model takes no `logits_to_keep`: its head on every position, then the kept ones [R, K, 1]."""
        return run(lay.inputs).logits.gather(1, lay.keep.unsqueeze(-1))
