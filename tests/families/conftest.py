"""The families tier: every supported model family, built at tiny size once per session in a temporary folder.

`family_dir(arch)` builds a family's checkpoint on first use and hands the same directory to every
later test, so a run of one family (`-k deepseek_v3`) builds only that one.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from miles_core.config import ModelConfig
from miles_core.config.model import FAMILY_ARCHS, MIN_LAYERS
from miles_core.models.tiny import build_tiny_model

# the families of the "bring your own model" issue: Qwen3 (dense and MoE) and every frontier family
FAMILIES = ("qwen3", "qwen3_moe", *FAMILY_ARCHS)


def tiny_config(arch: str, seed: int = 0) -> ModelConfig:
    """The tier's size: hidden 64, 4 heads (head_dim 16), 4 experts of width 32, top-2, the fewest layers
    that hold each of the family's layer kinds."""
    return ModelConfig(
        arch=arch,
        hidden_size=64,
        num_layers=MIN_LAYERS.get(arch, 2),
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        num_experts=4,
        moe_top_k=2,
        moe_intermediate_size=32,
        seed=seed,
    )


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = build_tiny_model(tiny_config(arch), str(root / arch))
        return built[arch]

    return get


@pytest.fixture(scope="session")
def family_tokenizer(family_dir):
    loaded = {}

    def get(arch: str):
        if arch not in loaded:
            loaded[arch] = AutoTokenizer.from_pretrained(family_dir(arch))
        return loaded[arch]

    return get
