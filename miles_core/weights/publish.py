"""Publishing: a policy version is an ordinary HF safetensors directory plus a lineage manifest (weights/manifest.py).

Any rollout engine (the embedded torch engine, SGLang's update_weights_from_disk) loads it as is. With train.lora a
version is the adapter alone in PEFT's format (weights/adapter.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from miles_core.config import LoraConfig
from miles_core.models.mtp import MTP_CONFIG, MTP_DIR, MTP_WEIGHTS, has_head
from miles_core.storage import atomic_dir
from miles_core.weights.adapter import write_adapter
from miles_core.weights.check import json_object, weight_files
from miles_core.weights.manifest import write_manifest
from miles_core.weights.quantize import quantize_dir

# What a checkpoint holds beside its weights that every version after it keeps: the tokenizer in any
# of its formats (fast, sentencepiece, BPE vocab + merges, tiktoken), its chat template, the generation config.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tiktoken.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def copy_tokenizer(src: str | Path, dst: str | Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)


class HfCheckpoint:
    """A checkpoint that holds the full model as an HF directory (the torch backend's, its draft head beside) seen as
    a trainer by `publish`: its weight files are exported one by one, each floating-point tensor cast to the published
    dtype, without building the model; a publishing pod holds one shard at a time and runs no model code."""

    def __init__(self, ckpt_dir: str | Path):
        self.ckpt_dir = Path(ckpt_dir)

    def export_hf(self, out_dir: str, dtype: str) -> None:
        out, total = Path(out_dir), 0
        for file in weight_files(self.ckpt_dir):
            tensors = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in load_file(file).items()}
            save_file(tensors, out / file.name, metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        index = self.ckpt_dir / "model.safetensors.index.json"
        if index.exists():  # the shards' total size changes with the dtype
            shards = json_object(index, "the shard index")
            (out / index.name).write_text(json.dumps({**shards, "metadata": {**shards.get("metadata", {}), "total_size": total}}, indent=2))
        shutil.copy2(self.ckpt_dir / "config.json", out / "config.json")
        if has_head(self.ckpt_dir):  # the draft head is published as trained (its optimizer state stays behind)
            (out / MTP_DIR).mkdir()
            for name in (MTP_WEIGHTS, MTP_CONFIG):
                shutil.copy2(self.ckpt_dir / MTP_DIR / name, out / MTP_DIR / name)


def publish(
    trainer,
    ckpt_dir: str,
    out_dir: str | Path,
    dtype: str,
    version: int,
    parent_version: int | None,
    source: str | None = None,
    quantization: str = "",
    adapter: tuple[LoraConfig, str] | None = None,
) -> dict:
    """Export the trainer's policy to out_dir as version `version` in `dtype`, its linear weights quantized if
    `quantization` names a format (weights/quantize.py); returns its manifest (its source: `source`, else ckpt_dir).
    `adapter` (train.lora, the base model's directory): the version is `trainer.adapter_state_dict()` alone, in PEFT's
    format, for that base, with the base's config.json (what reads the policy's vocabulary or architecture needs no base)."""
    lora, base_dir = adapter or (None, None)
    with atomic_dir(out_dir) as tmp:
        if lora is not None:
            write_adapter(tmp, trainer.adapter_state_dict(), lora, getattr(torch, dtype))
            shutil.copy2(Path(base_dir) / "config.json", tmp / "config.json")
        else:
            trainer.export_hf(str(tmp), dtype)
        if quantization:
            quantize_dir(tmp, quantization)
        copy_tokenizer(ckpt_dir, tmp)
        manifest = write_manifest(tmp, version, parent_version, source=source or str(ckpt_dir), base_dir=base_dir)
    return manifest
