"""LoRA served unmerged by a real SGLang 0.5.23 server on CPU (docs/lora.md): launched on the base with --enable-lora,
each published adapter version loaded by name, every request naming it, the previous one unloaded. Its greedy tokens
and log-probs are the embedded engine's, which applies the same adapter with PEFT over the same base."""

from __future__ import annotations

import pytest
import torch

from miles_core.config import LoraConfig, SGLangConfig, TrainConfig
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engines.sglang import SGLangEngine
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.train.torch_backend import TorchTrainer
from miles_core.weights.publish import publish
from tests.integration.test_sglang import EOS, PROMPTS, build_policy, greedy_tokens, sglang_env_python

pytestmark = pytest.mark.integration

LORA = LoraConfig(rank=4, alpha=8.0)  # every linear layer
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=10, stop_token_ids=(EOS,))
LOGPROB_TOLERANCE = 1e-4  # fp32 on both sides, as tests/integration/test_sglang.py


def adapter_version(base: str, out, version: int) -> str:
    """An adapter published from a LoRA trainer whose B matrices are random (PEFT starts them at zero: no change)."""
    trainer = TorchTrainer.from_hf(base, TrainConfig(lora=LORA))
    generator = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    publish(trainer, base, out, "float32", version, version - 1, adapter=(LORA, base))
    return str(out)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    sglang_env_python()
    root = tmp_path_factory.mktemp("sglang-lora")
    base = build_policy(root / "base", 0)
    versions = {version: adapter_version(base, root / f"policy-{version}", version) for version in (1, 2)}
    engine = SGLangEngine(SGLangConfig(startup_timeout_s=600, max_batch_sequences=8, max_concurrency=2), versions[1], 1, base_dir=base)
    yield engine, base, versions
    engine.close()


def test_each_adapter_version_is_served_unmerged_as_the_embedded_engine_serves_it(served):
    engine, base, versions = served
    unadapted = greedy_tokens(TorchEngine(base, 0).generate(PROMPTS, GREEDY))
    for version, policy in versions.items():
        engine.load_weights(policy, version)
        out = engine.generate(PROMPTS, GREEDY)
        embedded = TorchEngine(policy, version, base_dir=base).generate(PROMPTS, GREEDY)
        assert greedy_tokens(out) == greedy_tokens(embedded)
        assert greedy_tokens(out) != unadapted, f"adapter v{version} changed nothing"
        gaps = [abs(a - b) for gens, ref in zip(out, embedded) for a, b in zip(gens[0].logprobs, ref[0].logprobs)]
        assert max(gaps) < LOGPROB_TOLERANCE, f"max |SGLang - embedded| log-prob gap {max(gaps):.2e} with adapter v{version}"
        assert {gens[0].weight_version for gens in out} == {version}
