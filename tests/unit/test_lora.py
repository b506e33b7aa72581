"""LoRA on the torch backend (docs/lora.md): only the adapter is trained and checkpointed, the base stays bitwise,
the published adapter is PEFT's format that `peft.PeftModel.from_pretrained` loads onto the base with the trainer's
log-probs, and the embedded engine serves it unmerged with the same log-probs, swapping adapters by version."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from miles_core.config import LoraConfig, ModelConfig, TrainConfig
from miles_core.models import with_cache
from miles_core.models.loading import load_causal_lm
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.samples import Sample
from miles_core.train.base import pack
from miles_core.train.torch_backend import TorchTrainer
from miles_core.weights.check import CheckpointError
from miles_core.weights.manifest import read_manifest, weights_sha256
from miles_core.weights.publish import publish

TINY = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
LORA = TrainConfig(lr=1e-2, lora=LoraConfig(rank=4, alpha=8.0, target_modules="q_proj,v_proj,down_proj"))
LOGPROB_TOLERANCE = 1e-5  # fp32 on both sides, the same PEFT layers: only summation order may differ


def loss_fn(logprobs, entropy, mask, extras):
    return -logprobs * extras["advantage"][:, None], {}  # [b, T]


def batch_of(seed: int, rows: int = 8):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(rows):
        prompt, response = torch.randint(3, 100, (5,), generator=g).tolist(), torch.randint(3, 100, (4,), generator=g).tolist()
        samples.append(Sample(f"p{i}", 0, prompt, response, [0.0] * 4, [1] * 4, "length", 0, ""))
    advantage = torch.randn(rows, generator=g)
    return pack(samples, 0), {"advantage": advantage}


def logprobs_of(logits, batch) -> torch.Tensor:
    """Log-probs [b, T] of the batch's response tokens from a model's logits [b, L-1, V]."""
    targets = batch.input_ids[:, 1:].gather(1, batch.gather_index)  # [b, T]
    response = logits.log_softmax(-1).gather(1, batch.gather_index[..., None].expand(-1, -1, logits.shape[-1]))  # [b, T, V]
    return response.gather(2, targets[..., None])[..., 0] * batch.response_mask


def train(trainer: TorchTrainer, seeds) -> None:
    for seed in seeds:
        batch, extras = batch_of(seed)
        trainer.train_on(batch, extras, loss_fn, 1.0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(base dir, a LoRA trainer after two steps, its checkpoint dir, the adapter published from it as version 1)."""
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model(TINY, str(root / "base"))
    trainer = TorchTrainer.from_hf(base, LORA)
    train(trainer, (0, 1))
    ckpt = root / "ckpt"
    trainer.save_atomically(ckpt, base)
    published = root / "policy-1"
    publish(trainer, str(ckpt), published, "float32", 1, 0, adapter=(LORA.lora, base))
    return base, trainer, str(ckpt), published


def test_the_optimizer_holds_only_the_adapter_and_the_base_stays_bitwise(trained):
    base, trainer, _, _ = trained
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    named = dict(trainer.model.named_parameters())
    assert optimized == {id(p) for name, p in named.items() if ".lora_A." in name or ".lora_B." in name}
    assert {name.split(".")[-4] for name in named if ".lora_A." in name} == {"q_proj", "v_proj", "down_proj"}
    held = {name.replace(".base_layer", ""): value for name, value in trainer.model.get_base_model().state_dict().items() if "lora_" not in name}
    for name, value in load_file(f"{base}/model.safetensors").items():
        assert torch.equal(held[name], value), name
    assert all(float(p.detach().abs().sum()) > 0 for name, p in named.items() if ".lora_B." in name)  # the adapter did train


def test_a_checkpoint_holds_the_adapter_alone_and_resumes_bitwise(trained):
    base, trainer, ckpt, _ = trained
    assert not any(name.startswith("model") and name.endswith(".safetensors") for name in os.listdir(ckpt))
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors", "rng.pt", "trainer_state.json"} <= set(os.listdir(ckpt))
    assert os.path.getsize(f"{ckpt}/adapter_model.safetensors") * 10 < os.path.getsize(f"{base}/model.safetensors")
    resumed = TorchTrainer.load(ckpt, LORA, base)
    assert resumed.step == trainer.step == 2
    original = TorchTrainer.load(ckpt, LORA, base)  # the fixture's trainer stays as the other tests read it
    for t in (original, resumed):
        train(t, (2,))
    for (name, a), b in zip(original.adapter_state_dict().items(), resumed.adapter_state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="the base model's directory is needed"):
        TorchTrainer.load(ckpt, LORA)
    with pytest.raises(ValueError, match="an adapter checkpoint, and train.lora.rank is 0"):
        TorchTrainer.load(ckpt, TrainConfig(), base)


def test_the_published_adapter_is_pefts_format_and_loads_with_the_trainers_logprobs(trained):
    base, trainer, _, published = trained
    weights = load_file(published / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in weights
    assert all(k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in weights)
    config = json.loads((published / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, ["down_proj", "q_proj", "v_proj"])
    manifest = read_manifest(published)
    assert manifest["adapter"] == "peft-lora" and manifest["base_sha256"] == weights_sha256(base)
    assert manifest["weights_sha256"] == weights_sha256(published)
    model = PeftModel.from_pretrained(load_causal_lm(base, torch.float32), str(published))
    batch, _ = batch_of(7)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    assert torch.allclose(logprobs_of(logits, batch), trainer.logprobs(batch, 1.0), atol=LOGPROB_TOLERANCE, rtol=0)


def test_the_engine_serves_the_adapter_unmerged_with_the_trainers_logprobs(trained, tmp_path):
    base, trainer, ckpt, published = trained
    engine = TorchEngine(str(published), 1, base_dir=base)
    assert isinstance(engine.model, PeftModel) and engine.model.active_adapter == "v1"
    assert with_cache(engine.model, "kv") == {"cache": "kv"}  # the name its base model's forward takes
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, stop_token_ids=(), seed=3)
    prompts = [[1, 5, 6, 7], [1, 9, 10]]
    generations = engine.generate(prompts, params)
    samples = [
        Sample("p", 0, prompt, g.tokens, g.logprobs, [1] * len(g.tokens), g.finish_reason, 1, "") for prompt, gs in zip(prompts, generations) for g in gs
    ]
    batch = pack(samples, 0)
    assert torch.allclose(trainer.logprobs(batch, 1.0), batch.rollout_logprobs, atol=1e-4, rtol=0)
    # the next version's adapter replaces this one over the same base, which is never merged
    publish(trainer, ckpt, tmp_path / "policy-2", "float32", 2, 1, adapter=(LORA.lora, base))
    engine.load_weights(str(tmp_path / "policy-2"), 2)
    assert engine.model.active_adapter == "v2" and list(engine.model.peft_config) == ["v2"]
    base_weights = load_file(f"{base}/model.safetensors")
    q_proj = engine.model.get_base_model().model.layers[0].self_attn.q_proj
    assert torch.equal(q_proj.base_layer.weight, base_weights["model.layers.0.self_attn.q_proj.weight"])


def test_an_adapter_for_another_base_is_refused_naming_its_manifest(trained, tmp_path):
    _, _, _, published = trained
    other = build_tiny_model(dataclasses.replace(TINY, seed=1), str(tmp_path / "other"))
    with pytest.raises(CheckpointError, match="policy.json: base_sha256 .* is not the sha256 of the base model"):
        TorchEngine(str(published), 1, base_dir=other)
    with pytest.raises(CheckpointError, match="needs its base model's directory"):
        TorchEngine(str(published), 1)


def test_a_module_trained_in_full_is_optimized_and_published_beside_the_adapter(trained, tmp_path):
    base = trained[0]
    lora = LoraConfig(rank=2, target_modules="q_proj", trainable="lm_head")
    trainer = TorchTrainer.from_hf(base, TrainConfig(lr=1e-2, lora=lora))
    train(trainer, (0,))
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert {name for name, p in trainer.model.named_parameters() if id(p) in optimized and "lora_" not in name} == {
        "base_model.model.lm_head.modules_to_save.default.weight"
    }
    publish(trainer, base, tmp_path / "policy", "float32", 1, 0, adapter=(lora, base))
    assert json.loads((tmp_path / "policy" / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head"]
    model = PeftModel.from_pretrained(load_causal_lm(base, torch.float32), str(tmp_path / "policy"))
    batch, _ = batch_of(7)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    assert torch.allclose(logprobs_of(logits, batch), trainer.logprobs(batch, 1.0), atol=LOGPROB_TOLERANCE, rtol=0)
