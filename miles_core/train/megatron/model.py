"""The megatron backend's entry point: process groups, the GPTModel of an ArchSpec, DDP and optimizer.

Everything megatron-related in the project starts here: `init_parallel` activates the CPU
compatibility layer (only when no GPU is present) before any megatron-core module runs.
The model uses the local layer spec (megatron-core's own modules), so TransformerEngine and Apex
are optional: used on GPU nodes that have them, never required.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles_core.checkpoint import lora_map
from miles_core.checkpoint.arch import ArchSpec
from miles_core.config.base import ConfigError
from miles_core.net import free_port
from miles_core.train.megatron import arch_config, cpu_compat


@dataclass(frozen=True)
class Parallel:
    """Model-parallel sizes; data parallel is what is left of the world."""

    tensor: int = 1
    pipeline: int = 1
    expert: int = 1


def init_parallel(parallel: Parallel, seed: int) -> None:
    """Join (or, in a plain process, create a one-rank) gloo/nccl group and megatron's parallel groups."""
    cpu_compat.activate()
    from megatron.core import parallel_state, tensor_parallel  # optional backend: imported where used

    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a plain process (convert, publish, tests): a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    model_parallel = parallel.tensor * parallel.pipeline
    if world % model_parallel or (world // parallel.pipeline) % parallel.expert:
        raise ValueError(f"world size {world} does not fit tensor={parallel.tensor} x pipeline={parallel.pipeline} (x expert={parallel.expert})")
    if parallel_state.model_parallel_is_initialized():
        current = Parallel(
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        if current == parallel:  # a second model (e.g. the KL reference) shares the groups of the first
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=1,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_model(spec: ArchSpec, parallel: Parallel, dtype: torch.dtype = torch.float32, lora=None):
    """This rank's GPTModel stage (local layer spec, rotary positions, vocabulary padded for TP); with `lora` (a
    LoraConfig of rank > 0) its targeted linears carry adapters and every other weight is frozen (lora.py)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if lora is not None:
        refusal = lora_map.megatron_refusal(lora, spec, parallel.tensor)
        if refusal:
            raise ConfigError(f"{refusal[0]}: {refusal[1]}")
    config = arch_config.transformer_config(spec, parallel, dtype)
    model = GPTModel(
        config,
        arch_config.layer_spec(spec, config, lora),
        vocab_size=spec.padded_vocab_size,
        max_sequence_length=spec.max_positions,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tied_embeddings,
        **arch_config.rotary_options(spec),
    )
    if lora is not None:
        from miles_core.train.megatron.lora import freeze_base

        freeze_base(model)
    return model


def wrap_ddp(model, bucket_size: int | None = None):
    """megatron DDP with grads reduced in fp32, set up for the distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True, bucket_size=bucket_size)
    return DistributedDataParallel(model.config, ddp_config, model)


def build_optimizer(ddp_model, lr: float, weight_decay: float, betas: tuple[float, float], grad_clip: float):
    """Adam(W) sharded over data-parallel ranks (the distributed optimizer), with grad clipping.

    A bf16 model (train.dtype) trains on fp32 main parameters: with `bf16=True` and no precision-aware optimizer,
    megatron-core's DistributedOptimizer keeps an fp32 copy of each bf16 parameter shard (`shard_fp32_from_float16_groups`),
    steps Adam on it with fp32 moments (OptimizerConfig's main_params_dtype / exp_avg_dtype / exp_avg_sq_dtype, all fp32
    unless `use_precision_aware_optimizer`) and copies the result back to the bf16 weights."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=1e-8,
        clip_grad=grad_clip,
        use_distributed_optimizer=True,
        bf16=ddp_model.config.bf16,
        params_dtype=ddp_model.config.params_dtype,
    )
    optimizer = get_megatron_optimizer(config, [ddp_model])
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        _index_main_params_as_listed(part)
    return optimizer


def _index_main_params_as_listed(optimizer) -> None:
    """megatron-core 0.16.1's DistributedOptimizer maps each model parameter to its (group, position) in gradient-buffer
    order (`model_param_group_index_map`), but lists a group's main parameters fp32 model parameters first, then the
    fp32 copies of the bf16 ones.  A group that holds both (the fp32 norms beside bf16 biases, all without weight
    decay, in a bf16 model with biases: gpt-oss, GLM-4.5, Qwen2) then saves each parameter's optimizer state in another
    one's place: the checkpoint asserts on the shapes or, where they agree, swaps the states.  This re-indexes the
    positions as the group lists them."""
    members: dict[int, list] = {}
    for param, (group, position) in optimizer.model_param_group_index_map.items():
        members.setdefault(group, []).append((position, param))
    for group, indexed in members.items():
        ordered = [param for _, param in sorted(indexed, key=lambda pair: pair[0])]
        listed = [p for p in ordered if p.dtype == torch.float32] + [p for p in ordered if p.dtype != torch.float32]
        optimizer.model_param_group_index_map.update({param: (group, position) for position, param in enumerate(listed)})
