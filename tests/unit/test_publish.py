"""Publishing a torch checkpoint file by file (weights/publish.py `HfCheckpoint`), against the trainer's own export."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from miles_core.config import ModelConfig, TrainConfig
from miles_core.models.mtp import MTP_CONFIG, MTP_DIR, MTP_WEIGHTS
from miles_core.models.tiny import build_tiny_model
from miles_core.train.torch_backend import TorchTrainer
from miles_core.weights.check import weight_files
from miles_core.weights.publish import HfCheckpoint

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
HEAD = (f"{MTP_DIR}/{MTP_WEIGHTS}", f"{MTP_DIR}/{MTP_CONFIG}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A torch checkpoint with a draft head (train.mtp_lr), its weights moved away from the base's, and its trainer."""
    root = tmp_path_factory.mktemp("publish")
    trainer = TorchTrainer.from_hf(build_tiny_model(TINY, str(root / "base")), TrainConfig(lr=1e-2, mtp_lr=1e-2))
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    trainer.save(str(root / "ckpt"))
    return root / "ckpt", trainer


def test_a_float32_export_is_the_trainers_byte_for_byte(checkpoint, tmp_path):
    ckpt, trainer = checkpoint
    trainer.export_hf(str(tmp_path / "trainer"), "float32")
    (tmp_path / "files").mkdir()
    HfCheckpoint(ckpt).export_hf(str(tmp_path / "files"), "float32")
    for name in ("model.safetensors", "config.json", *HEAD):
        assert (tmp_path / "files" / name).read_bytes() == (tmp_path / "trainer" / name).read_bytes(), name


@pytest.mark.parametrize("shard_size", [None, "20KB"])
def test_a_cast_export_holds_every_tensor_cast_and_loads_as_the_trainers(checkpoint, tmp_path, shard_size):
    """bf16, from one file or from shards: each floating tensor of each file cast, the shard index's total size that
    of the cast shards, the head as trained; the model HF loads from it is the one it loads from the trainer's export."""
    ckpt, trainer = checkpoint
    if shard_size:
        trainer.model.save_pretrained(tmp_path / "sharded", max_shard_size=shard_size)
        shutil.copytree(ckpt / MTP_DIR, tmp_path / "sharded" / MTP_DIR)
        ckpt = tmp_path / "sharded"
        assert len(weight_files(ckpt)) > 1
    out = tmp_path / "files"
    out.mkdir()
    HfCheckpoint(ckpt).export_hf(str(out), "bfloat16")
    assert [f.name for f in weight_files(out)] == [f.name for f in weight_files(ckpt)]
    size = 0
    for file in weight_files(ckpt):
        source, cast = load_file(file), load_file(out / file.name)
        assert cast.keys() == source.keys()
        assert all(cast[k].dtype == torch.bfloat16 and torch.equal(cast[k], source[k].to(torch.bfloat16)) for k in source)
        size += sum(t.numel() * t.element_size() for t in cast.values())
    if shard_size:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == size
        assert index["weight_map"] == json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert all((out / name).read_bytes() == (ckpt / name).read_bytes() for name in HEAD)
    trainer.export_hf(str(tmp_path / "trainer"), "bfloat16")
    ours, theirs = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).state_dict() for d in (out, tmp_path / "trainer"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
