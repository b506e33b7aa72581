"""The megatron-core trainer backend: GPTModel, DDP + distributed optimizer, TP/PP/DP/EP from the recipe.

A `TrainerBase`, like the torch backend, so `step.train_step`, the mini-batch loop and the loss,
weights and metrics code are shared: this module only supplies per-token log-probs and entropy
(through `vocab_parallel_cross_entropy` and a vocab-parallel entropy), the backward pass of one
mini-batch and the optimizer step.
Every rank runs `step.train_step` on the whole batch (the same parquet file); each data-parallel rank
trains on its own rows of each mini-batch, and the mini-batch's aggregation weights are computed
over all its rows first, so the loss does not depend on the data-parallel size.

Micro-batches go through megatron-core's `forward_backward_func`, so pipeline parallelism works
as on a GPU cluster; the last pipeline stage computes log-probs and metrics and they are summed
to every rank.  A batch that carries the rollout's routing is routed as the rollout was (R3, routing.py).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from miles_core.checkpoint import lora_map, torch_dist
from miles_core.checkpoint.hf_megatron import ArchSpec, arch_spec, hf_to_megatron, megatron_to_hf, read_hf_config
from miles_core.config import TrainConfig
from miles_core.config.base import ConfigError
from miles_core.train.base import LossFn, PackedBatch, TrainerBase
from miles_core.train.megatron import logits as vocab
from miles_core.train.megatron.model import Parallel, build_model, build_optimizer, init_parallel, wrap_ddp
from miles_core.train.megatron.routing import RoutingReplay

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# optimizer state as the distributed optimizer holds it: saved and loaded without gathers; it reloads at
# the same tensor/pipeline/expert sizes (the model weights reload at any sizes)
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


class Micro(NamedTuple):
    batch: PackedBatch
    weights: torch.Tensor | None  # [b, T] the aggregation weights of these rows (training only)
    extras: dict  # {name: [b, ...]}


def _distributed_optimizers(optimizer) -> list:
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _adapters_only(ckpt_dir: str, state: dict, cfg: TrainConfig, base_dir: str | None) -> bool:
    """Whether the checkpoint holds LoRA adapters only (then its base comes from base_dir); refuses a mismatch."""
    saved = state.get("lora_rank", 0)
    if saved and saved != cfg.lora.rank:
        raise ConfigError(f"train.lora.rank: {ckpt_dir} holds adapters of rank {saved}, the recipe asks for {cfg.lora.rank}")
    if saved and base_dir is None:
        raise ValueError(f"{ckpt_dir}: holds LoRA adapters only (train.lora.rank {saved}): load it with the base model's HF directory")
    return bool(saved)


def parallel_of(cfg: TrainConfig) -> Parallel:
    return Parallel(tensor=cfg.tensor_parallel, pipeline=cfg.pipeline_parallel, expert=cfg.expert_parallel)


class MegatronTrainer(TrainerBase):
    def __init__(self, model, hf_config: dict, cfg: TrainConfig, step: int = 0):
        from megatron.core.distributed import finalize_model_grads  # optional backend: imported where used

        self.hf_config, self.spec, self.cfg, self.step = hf_config, arch_spec(hf_config), cfg, step
        self.ddp = wrap_ddp(model)
        self.ddp.config.no_sync_func = self.ddp.no_sync
        self.ddp.config.finalize_model_grads_func = finalize_model_grads
        self.ddp.config.variable_seq_lengths = True  # micro-batches differ in length (pipeline p2p sends shapes)
        self.optimizer = build_optimizer(self.ddp, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), cfg.grad_clip)
        self.routing = RoutingReplay(self.ddp.module, self.spec)

    @classmethod
    def _build(cls, spec: ArchSpec, cfg: TrainConfig):
        init_parallel(parallel_of(cfg), cfg.seed)
        torch.manual_seed(cfg.seed)
        model = build_model(spec, parallel_of(cfg), _DTYPES[cfg.dtype], cfg.lora if cfg.lora.rank else None)
        if cfg.lora.rank:  # fresh adapters; a checkpoint that holds adapters overwrites them
            from miles_core.train.megatron.lora import init_adapters  # megatron-core's own classes: imported where used

            init_adapters(model, spec, cfg.seed)
        return model

    @classmethod
    def from_hf(cls, policy_dir: str, cfg: TrainConfig) -> MegatronTrainer:
        hf_config = read_hf_config(policy_dir)
        spec = arch_spec(hf_config)
        model = cls._build(spec, cfg)
        torch_dist.load_full_state(model, spec, hf_to_megatron(spec, torch_dist.read_hf_state(policy_dir)))
        return cls(model, hf_config, cfg)

    @classmethod
    def load(cls, ckpt_dir: str, cfg: TrainConfig, base_dir: str | None = None) -> MegatronTrainer:
        """A torch_dist checkpoint at any parallel sizes; optimizer state when it has one.  A checkpoint trained with
        LoRA holds the adapters only: its frozen base model comes from `base_dir` (the HF policy it was trained from).
        With train.lora.rank > 0 a whole model's checkpoint (the converted policy) is the base of fresh adapters."""
        state = json.loads((Path(ckpt_dir) / "trainer_state.json").read_text()) if (Path(ckpt_dir) / "trainer_state.json").exists() else {"step": 0}
        hf_config = read_hf_config(ckpt_dir)
        adapters_only = _adapters_only(ckpt_dir, state, cfg, base_dir)
        trainer = cls.from_hf(base_dir, cfg) if adapters_only else cls(cls._build(arch_spec(hf_config), cfg), hf_config, cfg)
        trainer.step = state["step"]
        model_state = {k: v for k, v in trainer.ddp.module.sharded_state_dict().items() if lora_map.is_adapter(k) == adapters_only}
        wanted = {"model": model_state}
        same_layout = {k: v for k, v in state.get("parallel", {}).items() if k != "world_size"} == parallel_of(cfg).__dict__
        if state["step"] and not same_layout:
            logger.warning("%s: saved at parallel sizes %s, loading at %s: optimizer state starts afresh", ckpt_dir, state.get("parallel"), parallel_of(cfg))
        if state["step"] and same_layout and adapters_only == bool(cfg.lora.rank):
            # torch's Adam creates its state (step, moments) lazily; the loaded state is copied into it
            for optimizer in _distributed_optimizers(trainer.optimizer):
                optimizer._init_optimizer_states_with_dummy_values()
            wanted["optimizer"] = trainer.optimizer.sharded_state_dict(model_state, is_loading=True, metadata=_OPTIMIZER_FORMAT)
        loaded = torch_dist.load_torch_dist(wanted, ckpt_dir)
        trainer.ddp.module.load_state_dict(loaded["model"], strict=False)
        if "optimizer" in wanted:
            with torch.no_grad():  # copies into the main parameters, which require grad
                trainer.optimizer.load_state_dict(loaded["optimizer"])
            for optimizer in _distributed_optimizers(trainer.optimizer):
                # megatron-core 0.16.1 hands torch's Adam (no Apex/TE) one `step` tensor shared by every
                # parameter, which each parameter's update would then increment: give each its own
                for param_state in optimizer.optimizer.state.values():
                    param_state["step"] = param_state["step"].clone()
        rng = Path(ckpt_dir) / "rng" / f"rank_{dist.get_rank():05d}.pt"
        if rng.exists():  # another world size: keep the seeded state
            torch.set_rng_state(torch.load(rng, weights_only=True))
        return trainer

    def save(self, ckpt_dir: str) -> None:
        """Model (with LoRA: the adapters only, the base being frozen), optimizer state, RNG, step and parallel sizes."""
        model_state = {k: v for k, v in self.ddp.module.sharded_state_dict().items() if lora_map.is_adapter(k) or not self.cfg.lora.rank}
        state = {"model": model_state}
        if self.step:
            state["optimizer"] = self.optimizer.sharded_state_dict(model_state, metadata=_OPTIMIZER_FORMAT)
        torch_dist.save_torch_dist(state, ckpt_dir)
        (Path(ckpt_dir) / "rng").mkdir(exist_ok=True)
        torch.save(torch.get_rng_state(), Path(ckpt_dir) / "rng" / f"rank_{dist.get_rank():05d}.pt")
        if dist.get_rank() == 0:
            parallel = parallel_of(self.cfg).__dict__ | {"world_size": dist.get_world_size()}
            trainer_state = {"step": self.step, "backend": "megatron", "parallel": parallel, "lora_rank": self.cfg.lora.rank}
            (Path(ckpt_dir) / "trainer_state.json").write_text(json.dumps(trainer_state))
            (Path(ckpt_dir) / "config.json").write_text(json.dumps(self.hf_config, indent=2))
        dist.barrier()

    def _full_state(self) -> dict[str, torch.Tensor]:
        """The unsharded model; with LoRA, each adapted weight merged with its adapter (what the model computes)."""
        full = torch_dist.gather_full_state(self.ddp.module, self.spec)
        if not self.cfg.lora.rank:
            return full
        adapters = torch_dist.gather_full_state(self.ddp.module, self.spec, adapters=True)
        return lora_map.merged(full, adapters, self.cfg.lora.alpha / self.cfg.lora.rank)

    def export_hf(self, out_dir: str, dtype: str) -> None:
        full = self._full_state()
        if dist.get_rank() == 0:
            torch_dist.write_hf(self.spec, full, self.hf_config, out_dir, dtype)
        dist.barrier()

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter under PEFT's names, unsharded, on every rank (collective), as TorchDistCheckpoint's."""
        return lora_map.peft_adapter(self.spec, torch_dist.gather_full_state(self.ddp.module, self.spec, adapters=True))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (gathered) weights under HF names (LoRA merged); a tied output layer appears under both of its HF names."""
        hf = megatron_to_hf(self.spec, self._full_state())
        if self.spec.tied_embeddings and "lm_head.weight" not in hf:
            hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
        return hf

    def _schedule(self, micro_batches: list[PackedBatch], loss_of, forward_only: bool) -> list[dict]:
        """Run micro-batches through megatron's schedule; the last stage's per-micro-batch outputs."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data_iterator, model):
            micro = next(data_iterator)
            input_ids = vocab.padded_for_sequence_parallel(micro.batch.input_ids)
            with self.routing.around_forward(micro.batch.routed_experts, input_ids.shape[1]):
                output = model(input_ids=input_ids, position_ids=vocab.positions(input_ids), attention_mask=None)
            return output, functools.partial(loss_of, micro)

        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(micro_batches),
            model=[self.ddp],
            num_microbatches=len(micro_batches),
            seq_length=vocab.padded_for_sequence_parallel(micro_batches[0].batch.input_ids).shape[1],
            micro_batch_size=len(micro_batches[0].batch),
            forward_only=forward_only,
        )

    def _micro_batches(self, batch: PackedBatch, weights: torch.Tensor | None = None, extras: dict | None = None) -> list[Micro]:
        size, extras = self.cfg.micro_batch_size, extras or {}
        return [
            Micro(batch.select(slice(i, i + size)), None if weights is None else weights[i : i + size], {k: v[i : i + size] for k, v in extras.items()})
            for i in range(0, len(batch), size)
        ]

    def _stats(self, batch: PackedBatch, output: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab.response_logprobs_entropy(output, batch, temperature, self.spec.vocab_size)

    def routing_metrics(self) -> dict[str, float]:
        counts = torch.tensor(self.routing.agreement(), dtype=torch.float64)
        dist.all_reduce(counts)  # each rank's routers saw their own layers and tokens (data-parallel copies cancel out)
        return {"routing/agreement": float(counts[0] / counts[1])} if counts[1] else {}

    @torch.no_grad()
    def logprobs(self, batch: PackedBatch, temperature: float) -> torch.Tensor:
        self.routing.agreement(reset=True)  # routing_metrics: of this pass
        self.ddp.eval()

        def loss_of(micro, output):
            logprobs, _ = self._stats(micro.batch, output, temperature)
            return output.sum() * 0.0, {"logprobs": logprobs}

        outputs = self._schedule(self._micro_batches(batch), loss_of, forward_only=True)
        self.ddp.train()
        mine = torch.cat([o["logprobs"] for o in outputs]) if outputs else torch.zeros(batch.response_mask.shape)
        return vocab.from_last_stage(mine)  # [B, T] on every rank

    def _data_parallel_rows(self, start: int, stop: int) -> slice:
        from megatron.core import parallel_state

        size, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        per_rank = -(-(stop - start) // size)
        return slice(min(start + rank * per_rank, stop), min(start + (rank + 1) * per_rank, stop))

    def _check_batch(self, batch: PackedBatch) -> None:
        from megatron.core import parallel_state

        dp_size = parallel_state.get_data_parallel_world_size()
        if len(batch) // self.cfg.mini_batches < dp_size:
            raise ValueError(f"a mini-batch of {len(batch) // self.cfg.mini_batches} samples cannot be split over {dp_size} data-parallel ranks")

    def _backward(self, mini: PackedBatch, weights: torch.Tensor, extras: dict, loss_fn: LossFn, temperature: float) -> dict[str, torch.Tensor]:
        """This data-parallel rank's rows of the mini-batch through megatron's schedule (pipeline included)."""
        from megatron.core import parallel_state

        dp_size = parallel_state.get_data_parallel_world_size()
        rows = self._data_parallel_rows(0, len(mini))
        micro_batches = self._micro_batches(mini.select(rows), weights[rows], {k: v[rows] for k, v in extras.items()})

        def loss_of(micro, output):
            logprobs, entropy = self._stats(micro.batch, output, temperature)
            loss, metrics = loss_fn(logprobs, entropy, micro.batch.loss_mask, micro.extras)
            metrics = {"loss": loss.detach(), "entropy": entropy.detach(), **metrics}
            sums_here = {k: (v * micro.batch.loss_mask).sum().detach() for k, v in metrics.items()}
            # the schedule divides by the number of micro-batches and DDP averages over data-parallel
            # ranks: undo both, the weights already normalise over the whole mini-batch
            total = (loss * micro.weights).sum() * len(micro_batches) * dp_size
            return total, sums_here

        sums: dict[str, torch.Tensor] = {}
        for out in self._schedule(micro_batches, loss_of, forward_only=False):
            for k, v in out.items():
                sums[k] = sums.get(k, 0.0) + v
        return sums

    def _zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _optimizer_step(self) -> float:
        _, grad_norm, _ = self.optimizer.step()
        return float(grad_norm or 0.0)

    def _totals(self, sums: dict, tokens: float) -> dict[str, float]:
        return vocab.sum_over_data_and_pipeline(sums, tokens)

    def _is_writer(self) -> bool:
        return dist.get_rank() == 0

    def _barrier(self) -> None:
        dist.barrier()
