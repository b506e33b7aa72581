"""Rollout routing replay (R3, miles_core/routing.py) on the embedded engine and the torch trainer, tiny MoE models:
what the engine records, replay giving back the rollout's log-probs after the router moved, the agreement metric and
its health gate, the batch file round trip, and the refusal of routing that does not fit the model.
(The megatron trainer's replay: tests/integration/test_megatron_parallel.py; every MoE family: tests/families.)"""

import dataclasses

import pyarrow.parquet as pq
import pytest
import torch
import transformers

from miles_core.batch_io import read_batch, write_batch
from miles_core.config import HealthConfig, ModelConfig, RolloutConfig, TrainConfig
from miles_core.health import HealthGateTripped
from miles_core.models.loading import load_causal_lm
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.routing import RouterTaps, moe_layer_ids
from miles_core.samples import Sample
from miles_core.schemas import BatchError
from miles_core.step import bind, train_step
from miles_core.train.base import pack
from miles_core.train.torch_backend import TorchTrainer

MOE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, num_experts=4, moe_top_k=2, moe_intermediate_size=32)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
SAME = 1e-5  # fp32 log-probs of the same computation in another order (a KV-cached decode against one pass)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: build_tiny_model(ModelConfig(arch=arch, **MOE), str(root / arch)) for arch in ("qwen3_moe", "deepseek_v3")}


def rollout(policy_dir: str, n: int = 4) -> list[Sample]:
    engine = TorchEngine(policy_dir, record_routing=True)
    groups = engine.generate(PROMPTS, SamplingParams(n=n, temperature=1.0, max_new_tokens=10, seed=1))
    return [
        Sample(str(i), j, p, g.tokens, g.logprobs, [1] * len(g.tokens), g.finish_reason, 0, "x", reward=float(j % 2), routed_experts=g.routed_experts)
        for i, (p, group) in enumerate(zip(PROMPTS, groups))
        for j, g in enumerate(group)
    ]


def gap(trainer: TorchTrainer, samples: list[Sample], replay: bool = True) -> tuple[float, dict]:
    """The largest |trainer - rollout| log-prob over the response tokens, and the trainer's routing metrics."""
    batch = pack(samples, 0)
    batch = batch if replay else dataclasses.replace(batch, routed_experts=None)
    logprobs = trainer.logprobs(batch, 1.0)
    return float(((logprobs - batch.rollout_logprobs).abs() * batch.loss_mask).max()), trainer.routing_metrics()


def test_the_engine_records_the_experts_of_every_position_it_fed(models):
    """P + R - 1 positions x 2 MoE layers x top-2 per sample, the same experts a full forward over the sample chooses."""
    samples = rollout(models["qwen3_moe"])
    model = TorchTrainer.load_model(models["qwen3_moe"]).eval()
    taps = RouterTaps(model)
    assert (taps.layers, taps.top_k, taps.experts) == (2, 2, 4)
    for s in samples:
        fed = s.prompt_tokens + s.response_tokens[:-1]
        assert len(s.routed_experts) == len(fed) * 2 * 2
        with taps.recording(), torch.no_grad():
            model(input_ids=torch.tensor([fed]))
        assert taps.take().flatten().tolist() == s.routed_experts


@pytest.mark.parametrize(
    ("arch", "moved", "change"),
    [
        ("deepseek_v3", "e_score_correction_bias", lambda bias: bias + torch.linspace(-1, 1, len(bias))),  # selection only: replay is exact
        ("qwen3_moe", "gate.weight", lambda w: w + 0.02 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0))),
    ],
    ids=["selection-bias", "router-weights"],
)
def test_replay_gives_back_the_rollouts_logprobs_after_the_router_moved(models, arch, moved, change):
    """The same weights: replayed or not, the trainer's log-probs are the engine's, agreement 1. The router moved: routed
    by itself the trainer picks other experts for many tokens; replayed, only the gate values of the rollout's experts
    differ, which a selection bias never changes (DeepSeek-V3: exact) and a small router step changes a little."""
    samples = rollout(models[arch])
    trainer = TorchTrainer.from_hf(models[arch], TrainConfig())
    assert gap(trainer, samples) == (pytest.approx(0.0, abs=SAME), {"routing/agreement": 1.0})
    assert gap(trainer, samples, replay=False)[0] < SAME
    with torch.no_grad():
        for name, tensor in [*trainer.model.named_parameters(), *trainer.model.named_buffers()]:
            if name.endswith(moved):
                tensor.copy_(change(tensor))
    replayed, metrics = gap(trainer, samples)
    bare, _ = gap(trainer, samples, replay=False)
    assert metrics["routing/agreement"] < 0.9
    assert bare > 0.01
    assert replayed < (SAME if arch == "deepseek_v3" else bare / 3)


def test_agreement_is_logged_each_step_and_gated(models):
    samples = rollout(models["deepseek_v3"])
    fns = bind(rollout=RolloutConfig(n_samples=4), health=HealthConfig(min_routing_agreement=0.5))
    trainer = TorchTrainer.from_hf(models["deepseek_v3"], TrainConfig())
    metrics = train_step(trainer, samples, fns, pad_id=0)
    assert metrics["routing/agreement"] == metrics["health/routing_agreement"] == 1.0
    with torch.no_grad():
        for name, bias in trainer.model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias.add_(torch.linspace(-1, 1, len(bias)))
    with pytest.raises(HealthGateTripped, match=r"health gate routing_agreement tripped at [0-9.e-]+ \(health.min_routing_agreement is 0.5\)"):
        train_step(trainer, samples, fns, pad_id=0)


def test_routing_is_stored_with_the_batch_as_small_integers(models, tmp_path):
    samples = rollout(models["qwen3_moe"], n=2)
    write_batch(samples, str(tmp_path / "b.parquet"))
    back = read_batch(str(tmp_path / "b.parquet"))
    assert [s.routed_experts for s in back] == [s.routed_experts for s in samples]
    assert str(pq.read_schema(tmp_path / "b.parquet").field("routed_experts").type) == "list<element: int16>"


def test_a_batch_whose_routing_does_not_fit_the_model_is_refused(models, tmp_path):
    samples = rollout(models["qwen3_moe"], n=2)
    trainer = TorchTrainer.from_hf(models["qwen3_moe"], TrainConfig())
    one_layer = [dataclasses.replace(s, routed_experts=s.routed_experts[: len(s.routed_experts) // 2]) for s in samples]
    with pytest.raises(ValueError, match=r"the batch records 2 expert ids per token, this model routes 2 layers x top-2 = 4"):
        trainer.logprobs(pack(one_layer, 0), 1.0)
    unknown_expert = [dataclasses.replace(s, routed_experts=[e + 4 for e in s.routed_experts]) for s in samples]
    with pytest.raises(ValueError, match=r"the batch names expert 7, this model has 4"):
        trainer.logprobs(pack(unknown_expert, 0), 1.0)
    dense = build_tiny_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64), str(tmp_path / "dense"))
    with pytest.raises(ValueError, match=r"routing replay needs a mixture-of-experts model"):
        TorchTrainer.from_hf(dense, TrainConfig()).logprobs(pack(samples, 0), 1.0)


@pytest.mark.parametrize(
    ("routing", "check"),
    [(lambda s: [-1] * len(s.routed_experts), "expert_ids"), (lambda s: s.routed_experts[:-1], "routing_per_position")],
    ids=["negative-id", "not-per-position"],
)
def test_the_batch_schema_refuses_malformed_routing_naming_row_and_check(models, tmp_path, routing, check):
    samples = rollout(models["qwen3_moe"], n=2)
    samples[3] = dataclasses.replace(samples[3], routed_experts=routing(samples[3]))
    with pytest.raises(BatchError, match=rf"routed_experts.*check '{check}' failed at rows \[3\]"):
        write_batch(samples, str(tmp_path / "bad.parquet"))


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama4", "kimi_k25", "glm5_next"])
def test_the_layout_of_a_servers_routing_record_is_the_loaded_models_moe_layers(arch, tmp_path):
    """`moe_layer_ids` (how an SGLang server's record of every layer maps to the trainer's routed layers) from a
    checkpoint's config names the decoder layers with routed experts of the model `load_causal_lm` loads: interleaved
    ones (llama4), a multimodal checkpoint's language model, one whose text config has no causal LM class (glm5_next)."""
    build_tiny_model(ModelConfig(arch=arch), str(tmp_path))
    decoder = load_causal_lm(str(tmp_path)).get_decoder()
    layers = decoder.layers if hasattr(decoder, "layers") else decoder.model.layers  # Llama 4's decoder: a causal LM
    routed = [i for i, layer in enumerate(layers) if any(isinstance(getattr(m, "experts", None), torch.nn.Module) for m in layer.modules())]
    assert moe_layer_ids(transformers.AutoConfig.from_pretrained(tmp_path)) == routed != []
