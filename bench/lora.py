"""Bytes moved per weight update, full weights versus a LoRA adapter (docs/lora.md). Prints one JSON object.

tiny: measured from the directories a trainer actually publishes (full: model.safetensors; LoRA: adapter_model.safetensors)
for the default tiny model. real: the same figure for real-size configs built on the meta device (no memory, no weights):
the published tensors' bytes in bf16, the full model's parameters against the adapter's, all-linear at each rank.

python bench/lora.py [--ranks 16 64]
"""

import argparse
import tempfile
from pathlib import Path

import torch
from measure import emit
from transformers import AutoModelForCausalLM, Qwen3Config

from miles_core.config import LoraConfig, ModelConfig, TrainConfig
from miles_core.models.tiny import build_tiny_model
from miles_core.train.torch_backend import TorchTrainer
from miles_core.weights.adapter import adapter_state, with_adapters
from miles_core.weights.publish import publish

# Qwen3-8B's shape (its config.json): the weights are never built, only counted on the meta device
QWEN3_8B = Qwen3Config(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
)


def published_bytes(root: Path, ranks: list[int]) -> dict:
    """Bytes of the weight files a tiny model's trainer publishes, full and at each LoRA rank."""
    base = build_tiny_model(ModelConfig(), str(root / "base"))
    publish(TorchTrainer.from_hf(base, TrainConfig()), base, root / "full", "float32", 1, 0)
    out = {"full_bytes": (root / "full" / "model.safetensors").stat().st_size}
    for rank in ranks:
        lora = LoraConfig(rank=rank, alpha=2.0 * rank)
        publish(TorchTrainer.from_hf(base, TrainConfig(lora=lora)), base, root / f"r{rank}", "float32", 1, 0, adapter=(lora, base))
        size = (root / f"r{rank}" / "adapter_model.safetensors").stat().st_size
        out[f"lora_r{rank}_bytes"], out[f"lora_r{rank}_ratio"] = size, size / out["full_bytes"]
    return out


def counted_bytes(config, ranks: list[int], bytes_per_value: int = 2) -> dict:
    """The same figure for a real-size config, from parameter counts on the meta device (bf16: 2 bytes a value)."""
    with torch.device("meta"):
        full = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    out = {"full_bytes": full * bytes_per_value}
    for rank in ranks:
        with torch.device("meta"):
            model = with_adapters(AutoModelForCausalLM.from_config(config), LoraConfig(rank=rank, alpha=2.0 * rank))
        size = sum(t.numel() for t in adapter_state(model).values()) * bytes_per_value
        out[f"lora_r{rank}_bytes"], out[f"lora_r{rank}_ratio"] = size, size / out["full_bytes"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = published_bytes(Path(tmp), args.ranks)
    emit({"bench": "lora", "target_modules": "all-linear", "tiny_fp32_published": tiny, "qwen3_8b_bf16": counted_bytes(QWEN3_8B, args.ranks)})


if __name__ == "__main__":
    main()
