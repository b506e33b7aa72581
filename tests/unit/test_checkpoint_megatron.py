"""HF <-> megatron-core conversion for each supported architecture, with the real megatron-core (CPU, gloo).

Each architecture: build the tiny HF model, convert HF -> torch_dist -> HF, compare the weights
bitwise, and compare megatron's logits with HF's on the same input in fp32.
"""

import tempfile

import pytest

from tests.megatron_runs import run_worker

LOGIT_TOLERANCE = 1e-5  # fp32, same weights: only the summation order of the two implementations differs
ARCHS = ["qwen2", "qwen3", "llama", "qwen3_moe"]


@pytest.fixture(scope="module")
def converted():
    with tempfile.TemporaryDirectory(prefix="megatron-convert-") as tmp:  # not pytest's rotated temp folders
        yield run_worker("convert", tmp, *ARCHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_conversion_round_trip_and_logits(arch, converted):
    result = converted[arch]
    assert result["same_names"] and result["bitwise"], result
    assert result["max_logit_diff"] < LOGIT_TOLERANCE, result
    assert result["logit_scale"] > 0.1  # the logits compared are not all ~0


def test_mapping_fuses_grouped_qkv_and_gate_up():
    """The pure mapping, without megatron: q/k/v interleave per KV group, gate/up stack, vocab pads."""
    import torch

    from miles_core.checkpoint.hf_megatron import ArchSpec, hf_to_megatron, megatron_to_hf

    spec = ArchSpec("qwen2", 5, 4, 1, 4, 2, 1, 3, 1e-6, 1e4, 16, True, True, False)
    hf = {
        "model.embed_tokens.weight": torch.randn(5, 4),
        "model.norm.weight": torch.ones(4),
        "model.layers.0.input_layernorm.weight": torch.ones(4),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(4),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(4, 4),
        "model.layers.0.mlp.gate_proj.weight": torch.full((3, 4), 1.0),
        "model.layers.0.mlp.up_proj.weight": torch.full((3, 4), 2.0),
        "model.layers.0.mlp.down_proj.weight": torch.randn(4, 3),
    }
    for name, rows, base in (("q", 4, 0), ("k", 2, 10), ("v", 2, 20)):
        hf[f"model.layers.0.self_attn.{name}_proj.weight"] = (base + torch.arange(rows)).float().unsqueeze(1).expand(rows, 4).clone()
        hf[f"model.layers.0.self_attn.{name}_proj.bias"] = (base + torch.arange(rows)).float()
    mg = hf_to_megatron(spec, hf)
    # two KV groups of [2 query heads, 1 key head, 1 value head], head_dim 1
    assert mg["decoder.layers.0.self_attention.linear_qkv.bias"].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert mg["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [1, 1, 1, 2, 2, 2]
    assert mg["embedding.word_embeddings.weight"].shape == (128, 4) and "output_layer.weight" not in mg
    back = megatron_to_hf(spec, mg)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_unsupported_model_type_names_the_file(tmp_path):
    from miles_core.checkpoint.hf_megatron import read_arch

    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match=r"config.json: model_type 'gpt2' is not supported"):
        read_arch(tmp_path)
