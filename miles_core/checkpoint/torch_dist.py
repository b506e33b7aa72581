"""HF safetensors <-> Megatron distributed checkpoints (torch_dist, via `dist_checkpointing`).

A megatron checkpoint directory holds:
  config.json      the HF config of the model (what ArchSpec is read from)
  model/           the torch_dist checkpoint: {"model": GPTModel state[, "optimizer": ...]}
  trainer_state.json, rng/   (written by the trainer: step, parallel sizes, per-rank RNG)
  tokenizer files  copied beside, as for every checkpoint of the project

`dist_checkpointing` reshards on load, so a checkpoint saved at TP=2 loads at TP=1 (or at other
PP/EP sizes).  Conversion runs in one process (a world of one): HF -> unsharded GPTModel ->
torch_dist, and back.  `local_state` / `gather_full_state` move between the unsharded state and one
rank's shards in memory (for the trainer's `from_hf` and `export_hf`).
"""

from __future__ import annotations

import json
import queue
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from miles_core.checkpoint.hf_megatron import ArchSpec, export_config, hf_to_megatron, keeps_fp32, megatron_to_hf, read_arch, read_hf_config
from miles_core.checkpoint.lora_map import is_adapter, peft_adapter
from miles_core.train.megatron.model import Parallel, build_model, init_parallel

MODEL_DIR = "model"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_hf_state(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        state.update(load_file(str(path)))
    if not state:
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors weights")
    return state


def _layer_offset(model) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # optional backend

    return get_transformer_layer_offset(model.config)


def global_name(model, name: str) -> str:
    """This rank's parameter name -> the unsharded model's name (pipeline layer offset, expert index)."""
    from megatron.core import parallel_state

    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + _layer_offset(model))
    if "local_experts" in parts:
        i = parts.index("local_experts") + 1
        local = model.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        parts[i] = str(parallel_state.get_expert_model_parallel_rank() * local + int(parts[i]))
    return ".".join(parts)


def _tp_group(name: str):
    from megatron.core import parallel_state

    if "local_experts" in name:
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def _is_gated_fc1(name: str) -> bool:
    return name.endswith(("linear_fc1.weight", "linear_fc1.lora_B"))  # every supported architecture uses SwiGLU: [gate; up]


def _shard(name: str, param, full: torch.Tensor) -> torch.Tensor:
    group = _tp_group(name)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if _is_gated_fc1(name):  # each rank holds [its gate rows; its up rows]
        return torch.cat([half.chunk(size, dim)[rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(size, dim)[rank]


def _unshard(name: str, param) -> torch.Tensor:
    group = _tp_group(name)
    size = dist.get_world_size(group)
    local = param.detach()
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return local.clone()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    dim = param.partition_dim
    if _is_gated_fc1(name):
        halves = [s.chunk(2, dim) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim)
    return torch.cat(shards, dim)


def _source_name(spec: ArchSpec, name: str) -> str:
    # a tied output layer on the last pipeline stage is a copy of the embedding
    return "embedding.word_embeddings.weight" if name == "output_layer.weight" and spec.tied_embeddings else name


def _tensors(model, adapters: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The model's weights: its parameters and the routers' expert biases (buffers that the checkpoint holds), or its
    LoRA adapters (miles_core/train/megatron/lora.py) alone."""
    weights = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias"))]
    return [(n, t) for n, t in weights if is_adapter(n) == adapters]


def full_shapes(model, adapters: bool = False) -> dict[str, torch.Size]:
    """The unsharded shape of each of this rank's weights (or adapters), by unsharded name."""
    shapes = {}
    for name, param in _tensors(model, adapters):
        shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            shape[param.partition_dim] *= dist.get_world_size(_tp_group(name))
        shapes[global_name(model, name)] = torch.Size(shape)
    return shapes


@torch.no_grad()
def load_full_state(model, spec: ArchSpec, full: dict[str, torch.Tensor], adapters: bool = False) -> None:
    """Copy an unsharded GPTModel state (or its adapters) into this rank's shards of `model` (an unwrapped GPTModel)."""
    for name, param in _tensors(model, adapters):
        param.copy_(_shard(name, param, full[_source_name(spec, global_name(model, name))]))


@torch.no_grad()
def gather_full_state(model, spec: ArchSpec, adapters: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded GPTModel state (or its adapters), on every rank (collective over the whole world)."""
    mine = {}
    for name, param in _tensors(model, adapters):
        full = _unshard(name, param)
        key = global_name(model, name)
        if not (key == "output_layer.weight" and spec.tied_embeddings):
            mine[key] = full
    if dist.get_world_size() == 1:
        return mine
    everyone: list[dict] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # pipeline stages and expert ranks hold different names
    return {k: v for part in everyone for k, v in part.items()}


def save_torch_dist(state: dict, ckpt_dir: str | Path) -> None:
    """Save a sharded state dict ({"model": model.sharded_state_dict(), ...}) under ckpt_dir/model."""
    from megatron.core import dist_checkpointing  # optional backend: imported where used
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # megatron-core 0.16 hands a save's write results to its caller through the queue of a multiprocessing Manager that
    # it starts, once per process, by the spawn method: a new interpreter importing the main module (flytekit's CLI in a
    # task), 2-5 s of the first save of every process, and each train task's processes are new ones. A synchronous save
    # (every save here) puts and gets those results in the saving process itself, so a queue of that process does.
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    out = Path(ckpt_dir) / MODEL_DIR
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, str(out))


def load_torch_dist(state: dict, ckpt_dir: str | Path) -> dict:
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(state, str(Path(ckpt_dir) / MODEL_DIR))


def hf_to_torch_dist(hf_dir: str | Path, ckpt_dir: str | Path, seed: int = 0) -> ArchSpec:
    """Convert an HF checkpoint to a torch_dist checkpoint (model only) in one process (or in each of a group's, each
    saving its share)."""
    spec = read_arch(hf_dir)
    init_parallel(Parallel(), seed)
    model = build_model(spec, Parallel())
    load_full_state(model, spec, {k: v.float() for k, v in hf_to_megatron(spec, read_hf_state(hf_dir)).items()})
    save_torch_dist({"model": model.sharded_state_dict()}, ckpt_dir)
    if dist.get_rank() == 0:
        shutil.copy2(Path(hf_dir) / "config.json", Path(ckpt_dir) / "config.json")
    dist.barrier()
    return spec


def load_megatron_model(ckpt_dir: str | Path, parallel: Parallel = Parallel(), seed: int = 0):
    """This rank's GPTModel with the checkpoint's weights, at any parallel sizes."""
    spec = read_arch(ckpt_dir)
    init_parallel(parallel, seed)
    model = build_model(spec, parallel)
    model.load_state_dict(load_torch_dist({"model": model.sharded_state_dict()}, ckpt_dir)["model"], strict=False)
    return model, spec


def write_hf(spec: ArchSpec, full: dict[str, torch.Tensor], hf_config: dict, out_dir: str | Path, dtype: str) -> None:
    """An HF safetensors directory (model.safetensors + config.json) from an unsharded GPTModel state (a multimodal
    checkpoint's text model: what megatron trains), in `dtype` but for the tensors HF keeps in fp32."""
    hf = {k: v.to(torch.float32 if keeps_fp32(spec, k) else _DTYPES[dtype]).contiguous() for k, v in megatron_to_hf(spec, full).items()}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_file(hf, str(Path(out_dir) / "model.safetensors"), metadata={"format": "pt"})
    (Path(out_dir) / "config.json").write_text(json.dumps({**export_config(hf_config), "dtype": dtype}, indent=2))


def torch_dist_to_hf(ckpt_dir: str | Path, out_dir: str | Path, dtype: str = "float32") -> None:
    """Export a torch_dist checkpoint (any TP/PP/EP it was saved at) as HF safetensors, in one process."""
    model, spec = load_megatron_model(ckpt_dir)
    write_hf(spec, gather_full_state(model, spec), read_hf_config(ckpt_dir), out_dir, dtype)


def _unstacked(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A checkpoint tensor by unsharded GPTModel name: a dense model's layers are stacked on a first axis under one key."""
    head, _, rest = key.partition("decoder.layers.")
    if not rest or rest.split(".")[0].isdigit():
        return {key: tensor}
    return {f"{head}decoder.layers.{i}.{rest}": layer for i, layer in enumerate(tensor.unbind(0))}


def read_adapters(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """The unsharded LoRA adapters of a checkpoint (by GPTModel name), read without building the model."""
    from megatron.core import dist_checkpointing

    init_parallel(Parallel(), seed=0)
    model_dir = str(Path(ckpt_dir) / MODEL_DIR)
    wanted = {k: v for k, v in dist_checkpointing.load_tensors_metadata(model_dir).items() if is_adapter(k)}
    if not wanted:
        raise FileNotFoundError(f"{ckpt_dir}: no LoRA adapters in the checkpoint (trained with train.lora.rank 0)")
    loaded = dist_checkpointing.load(wanted, model_dir, validate_access_integrity=False)
    return {name: t for key, stacked in loaded.items() for name, t in _unstacked(key, stacked).items()}


class TorchDistCheckpoint:
    """A torch_dist checkpoint seen as a trainer by `weights.publish` (which asks for `export_hf`, or for
    `adapter_state_dict` when it was trained with LoRA)."""

    def __init__(self, ckpt_dir: str | Path):
        self.ckpt_dir = ckpt_dir

    def export_hf(self, out_dir: str, dtype: str) -> None:
        torch_dist_to_hf(self.ckpt_dir, out_dir, dtype)

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter under PEFT's names (base_model.model.<HF module>.lora_A/B.weight), unsharded."""
        return peft_adapter(read_arch(self.ckpt_dir), read_adapters(self.ckpt_dir))
