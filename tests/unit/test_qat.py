"""Int4 quantization-aware training (train.qat, miles_core/train/qat.py): the straight-through gradient, the weights it
fake-quantizes being exactly those an int4 publish quantizes, and the train/rollout mismatch of an int4 rollout
vanishing with QAT where it does not without."""

import pytest
import torch
from safetensors.torch import load_file

from miles_core.algos.corrections import mismatch_metrics
from miles_core.config import AlgoConfig, ModelConfig, PublishConfig, RolloutConfig, TrainConfig
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.samples import Sample
from miles_core.step import bind, optimize
from miles_core.train.base import pack
from miles_core.train.qat import StraightThrough, qat_weights
from miles_core.train.torch_backend import TorchTrainer
from miles_core.weights.int4 import fake_quantize_int4
from miles_core.weights.publish import publish
from miles_core.weights.quantize import dequantize_state

PROMPTS = [[1, 5, 6, 7], [1, 9, 4], [1, 12, 13, 14, 15], [1, 20]]
GROUP = 4  # responses per prompt
PAD_ID = 0  # the tiny tokenizer's pad token, its first id (miles_core/models/tiny.py)
QAT_TOLERANCE = 1e-5  # mean |log-prob difference|: the same fp32 weights on both sides, only the order of sums may differ


def tiny(arch: str, group: int, path) -> str:
    """A tiny `arch` model whose projections' input sizes (hidden 128, MLP 256, experts' 64 or 128) take `group`."""
    cfg = ModelConfig(arch=arch, hidden_size=128, num_layers=2, intermediate_size=256, num_experts=4, moe_intermediate_size=max(64, group))
    return build_tiny_model(cfg, str(path))


def test_the_gradient_goes_straight_through_to_the_master_weight():
    """d loss / d w under QAT is the plain gradient w.r.t. the fake-quantized weight it computed with."""
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 64, generator=g))
    x, y = torch.randn(5, 64, generator=g), torch.randn(5, 16, generator=g)
    out = x @ StraightThrough.apply(w, 32).T
    ((out - y) ** 2).sum().backward()
    quantized = fake_quantize_int4(w.detach(), 32).requires_grad_()
    reference = x @ quantized.T
    ((reference - y) ** 2).sum().backward()
    assert torch.equal(out, reference) and not torch.equal(quantized, w)
    assert torch.equal(w.grad, quantized.grad)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_qat_fake_quantizes_exactly_what_an_int4_publish_quantizes(arch, tmp_path):
    """The weights QAT computes with, exported as they are, are the published int4 policy's restored weights: the
    2-D projections and qwen3_moe's fused experts (saved per expert) quantized, gpt-oss's stacked experts (saved
    stacked, published unquantized) and every router, norm and embedding not."""
    base = tiny(arch, 32, tmp_path / "base")
    trainer = TorchTrainer.from_hf(base, TrainConfig(qat="int4", qat_group_size=32))
    names = qat_weights(trainer.model)
    experts = [n for n in names if "experts" in n]
    assert experts if arch == "qwen3_moe" else not experts
    assert all(n.endswith("proj") or n.endswith("proj.weight") for n in names) and len(names) >= 8
    publish(trainer, base, tmp_path / "int4", "float32", version=1, parent_version=0, quantization="int4-g32")
    with torch.no_grad():
        for name in names:
            trainer.model.get_parameter(name).copy_(fake_quantize_int4(trainer.model.get_parameter(name), 32))
    publish(trainer, base, tmp_path / "fake", "float32", version=1, parent_version=0)
    restored, fake = dequantize_state(load_file(str(tmp_path / "int4/model.safetensors")), "int4-g32"), load_file(str(tmp_path / "fake/model.safetensors"))
    assert restored.keys() == fake.keys()
    assert [n for n in fake if not torch.equal(fake[n], restored[n])] == []


def test_qat_leaves_the_parameters_and_their_names_in_place(tmp_path):
    base = tiny("qwen2", 32, tmp_path / "base")
    plain, qat = TorchTrainer.from_hf(base, TrainConfig()), TorchTrainer.from_hf(base, TrainConfig(qat="int4", qat_group_size=32))
    params = dict(qat.model.named_parameters())
    batch = pack([Sample("p", 0, [1, 5, 6], [7, 8], [-1.0, -1.0], [1, 1], "length", 0, "")], PAD_ID)
    qat.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.sum().backward()  # the trainer's forward
    assert dict(qat.model.named_parameters()) == params and qat.model.state_dict().keys() == plain.model.state_dict().keys()
    assert all(params[n].grad is not None for n in qat_weights(qat.model))
    assert not torch.equal(qat.logprobs(batch, 1.0), plain.logprobs(batch, 1.0))


def test_qat_refuses_a_weight_its_groups_do_not_divide(tmp_path):
    base = build_tiny_model(ModelConfig(hidden_size=64, num_layers=1, intermediate_size=128), str(tmp_path / "base"))
    with pytest.raises(ValueError, match=r"train.qat_group_size: model.layers.0.self_attn.q_proj.weight has 64 inputs, not a multiple of 128"):
        TorchTrainer.from_hf(base, TrainConfig(qat="int4"))


def scored(engine: TorchEngine, version: int) -> list[Sample]:
    """Responses sampled by `engine` with its log-probs, rewarded 1 when they hold an even token (a GRPO batch)."""
    generations = engine.generate(PROMPTS, SamplingParams(n=GROUP, temperature=1.0, max_new_tokens=6, seed=version))
    samples = []
    for p, (prompt, group) in enumerate(zip(PROMPTS, generations)):
        for i, g in enumerate(group):
            sample = Sample(f"p{p}", i, prompt, g.tokens, g.logprobs, [1] * len(g.tokens), g.finish_reason, version, "")
            sample.reward = float(any(t % 2 == 0 for t in g.tokens))
            samples.append(sample)
    return samples


@pytest.mark.parametrize("arch, group", [("qwen2", 32), ("qwen2", 128), ("qwen3_moe", 32)])
def test_qat_trains_on_the_numbers_the_int4_rollout_computes_with(arch, group, tmp_path):
    """Each trainer (with and without QAT) takes one GRPO step, publishes its policy as int4 and its engine samples a
    batch; the trainer's log-probs of those tokens differ from the rollout's by mismatch/abs_logprob_diff. With QAT
    the trainer computes with the very weights the engine restored: the mismatch is rounding only (< 1e-5); without
    it the int4 rounding of every projection shows (> 1e-3)."""
    base = tiny(arch, group, tmp_path / "base")
    fns = bind(algo=AlgoConfig(), rollout=RolloutConfig(n_samples=GROUP, temperature=1.0))
    first = scored(TorchEngine(base, 0), 0)
    fmt = PublishConfig(quantization="int4", group_size=group).fmt
    mismatch = {}
    for qat in ("", "int4"):
        trainer = TorchTrainer.from_hf(base, TrainConfig(lr=1e-2, qat=qat, qat_group_size=group if qat else 128))
        optimize(trainer, first, fns, PAD_ID)
        publish(trainer, base, tmp_path / f"int4{qat}", "float32", version=1, parent_version=0, quantization=fmt)
        batch = pack(scored(TorchEngine(str(tmp_path / f"int4{qat}"), 1), 1), PAD_ID)
        mismatch[qat] = mismatch_metrics(trainer.logprobs(batch, 1.0), batch.rollout_logprobs, batch.loss_mask)["mismatch/abs_logprob_diff"]
    assert mismatch["int4"] < QAT_TOLERANCE < 1e-3 < mismatch[""]
