"""Each family's tiny checkpoint: deterministic, the family's own classes and distinctive parts, a
vision-language one saved whole and loaded as its text causal LM, and accepted by `check_hf_dir`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from miles_core.config import ConfigError
from miles_core.config.model import MODEL_ARCHS
from miles_core.models import is_multimodal, text_config
from miles_core.models.families import FAMILIES as TABLE
from miles_core.models.loading import expected_tensors, load_causal_lm
from miles_core.models.tiny import build_tiny_model
from miles_core.weights.check import CheckpointError, check_hf_dir
from tests.families.conftest import FAMILIES, tiny_config

pytestmark = pytest.mark.families

MULTIMODAL = {"qwen3_5", "qwen3_5_moe", "kimi_k25", "llama4", "glm5_next"}


def _layer_kinds(config, name: str) -> set:
    return set(getattr(config, name) or [])


# what makes each family itself, read from its tiny text config
DISTINCTIVE = {
    "qwen3": lambda c: c.head_dim * c.num_attention_heads == c.hidden_size,
    "qwen3_moe": lambda c: c.num_experts > c.num_experts_per_tok > 1,
    "qwen3_5": lambda c: _layer_kinds(c, "layer_types") == {"linear_attention", "full_attention"},
    "qwen3_5_moe": lambda c: _layer_kinds(c, "layer_types") == {"linear_attention", "full_attention"} and c.shared_expert_intermediate_size > 0,
    "qwen3_next": lambda c: _layer_kinds(c, "layer_types") == {"linear_attention", "full_attention"} and c.shared_expert_intermediate_size > 0,
    "deepseek_v3": lambda c: c.q_lora_rank and c.kv_lora_rank and c.n_shared_experts and c.first_k_dense_replace == 1 and c.n_group == 2,
    "deepseek_v32": lambda c: c.kv_lora_rank and c.index_topk < 32 and c.first_k_dense_replace == 1,
    "deepseek_v4": lambda c: len(_layer_kinds(c, "layer_types")) == 3 and _layer_kinds(c, "mlp_layer_types") == {"hash_moe", "moe"} and c.hc_mult > 1,
    "kimi_k25": lambda c: c.model_type == "deepseek_v3" and c.kv_lora_rank and c.n_shared_experts,
    "glm4_moe": lambda c: c.attention_bias and c.rope_parameters["partial_rotary_factor"] == 0.5 and c.n_shared_experts,
    "glm_moe_dsa": lambda c: c.kv_lora_rank and _layer_kinds(c, "indexer_types") == {"full", "shared"},
    "glm5_next": lambda c: (
        _layer_kinds(c, "layer_types") == {"linear_attention", "indexed_attention"} and _layer_kinds(c, "indexer_types") == {"full", "shared"}
    ),
    "llama4": lambda c: c.attention_chunk_size < 32 and 0 in c.no_rope_layers and len(c.moe_layers) < c.num_hidden_layers,
    "gpt_oss": lambda c: _layer_kinds(c, "layer_types") == {"sliding_attention", "full_attention"} and c.rope_parameters["rope_type"] == "yarn",
    "minimax_m2": lambda c: c.num_local_experts > c.num_experts_per_tok and c.rope_parameters["partial_rotary_factor"] < 1,
    "nemotron_h": lambda c: _layer_kinds(c, "layers_block_type") == {"linear_attention", "full_attention", "moe"},  # mamba, attention, MoE
}


def _tensors(directory: str) -> dict[str, tuple]:
    with safe_open(str(Path(directory) / "model.safetensors"), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 - safe_open is no mapping


def test_every_arch_has_a_family_and_the_tier_covers_every_family():
    assert set(TABLE) == set(MODEL_ARCHS)
    assert set(FAMILIES) == set(MODEL_ARCHS) - {"qwen2", "llama"}  # the main recipes' own two are tested in tests/unit


@pytest.mark.parametrize("arch", FAMILIES)
def test_build_is_deterministic(arch, family_dir, tmp_path):
    first = Path(family_dir(arch))
    again = Path(build_tiny_model(tiny_config(arch), str(tmp_path / arch)))
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in again.iterdir())
    for file in first.iterdir():
        assert file.read_bytes() == (again / file.name).read_bytes(), file.name
    other = Path(build_tiny_model(tiny_config(arch, seed=1), str(tmp_path / "other")))
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_checkpoint_is_the_family_with_its_distinctive_parts(arch, family_dir):
    config = transformers.AutoConfig.from_pretrained(family_dir(arch))
    assert config.architectures == [TABLE[arch].model_class]
    assert is_multimodal(config) == (arch in MULTIMODAL)
    assert DISTINCTIVE[arch](text_config(config)), arch
    if arch in MULTIMODAL:  # the whole checkpoint, vision tower included, as a user holds it
        assert any("vision" in name or "visual" in name for name in _tensors(family_dir(arch)))


@pytest.mark.parametrize("arch", FAMILIES)
def test_check_hf_dir_passes_and_names_a_missing_language_tensor(arch, family_dir, tmp_path):
    check_hf_dir(family_dir(arch))
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in Path(family_dir(arch)).iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(broken / "model.safetensors"))
    config = transformers.AutoConfig.from_pretrained(broken)
    victim = sorted(name for name in expected_tensors(config) if "norm" in name)[-1]  # a language-model tensor, as saved
    save_file({k: v for k, v in tensors.items() if k != victim}, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor {victim} missing"):
        check_hf_dir(broken)


@pytest.mark.parametrize("arch", sorted(MULTIMODAL))
def test_a_multimodal_checkpoint_loads_as_its_text_causal_lm(arch, family_dir):
    model = load_causal_lm(family_dir(arch))
    vision = [name for name, p in model.named_parameters() if p.requires_grad and ("vision" in name or "visual" in name)]
    assert model.config.get_text_config(decoder=True).vocab_size == model.get_output_embeddings().weight.shape[0] and not vision
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[3, 40, 50]])).logits
    assert logits.shape[:2] == (1, 3) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "arch,changes,key",
    [
        ("deepseek_v4", {"num_layers": 2}, "model.num_layers"),
        ("llama4", {"num_layers": 3}, "model.num_layers"),
        ("gpt_oss", {"hidden_size": 48}, "model.hidden_size"),
    ],
)
def test_a_size_that_drops_a_family_part_is_refused(arch, changes, key):
    with pytest.raises(ConfigError, match=key):
        dataclasses.replace(tiny_config(arch), **changes)
