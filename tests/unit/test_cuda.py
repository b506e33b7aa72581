"""The embedded engine and the torch trainer on a CUDA device give what they give on the CPU: the same greedy tokens
(ordinary and speculative decoding), the same log-probs, and the same GRPO step, within float32 rounding.

Skipped where torch sees no CUDA device: the suite needs no GPU. Run on a GPU machine with
`python -m pytest -q --noconftest tests/unit/test_cuda.py` (its imports are torch, transformers and the project)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoConfig

from miles_core.config import ModelConfig, RolloutConfig, TrainConfig
from miles_core.models.mtp import build_head, save_head
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.samples import Sample
from miles_core.step import bind, optimize
from miles_core.train.base import pack
from miles_core.train.torch_backend import TorchTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20], [30, 31]]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> str:
    """The project's tiny Qwen2 with an (untrained) MTP draft head beside it."""
    root = build_tiny_model(ModelConfig(), str(tmp_path_factory.mktemp("cuda") / "policy"))
    save_head(build_head(AutoConfig.from_pretrained(root)), root)
    return root


def generations(engine: TorchEngine, params: SamplingParams) -> list:
    return [g for gens in engine.generate(PROMPTS, params) for g in gens]


@pytest.mark.parametrize("speculative_tokens", [0, 2])
def test_engine_on_cuda_decodes_as_on_cpu(policy_dir, speculative_tokens):
    cpu, cuda = (TorchEngine(policy_dir, speculative_tokens=speculative_tokens, device=device) for device in ("cpu", "cuda"))
    assert next(cuda.model.parameters()).is_cuda
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=12)
    on_cpu, on_cuda = generations(cpu, greedy), generations(cuda, greedy)
    assert [g.tokens for g in on_cuda] == [g.tokens for g in on_cpu]
    torch.testing.assert_close(torch.tensor([x for g in on_cuda for x in g.logprobs]), torch.tensor([x for g in on_cpu for x in g.logprobs]), atol=1e-4, rtol=0)
    sampled = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=3)
    same = sum(a.tokens == b.tokens for a, b in zip(generations(cpu, sampled), generations(cuda, sampled)))
    assert same >= 14, f"the same uniforms on both devices should draw the same tokens but for rounding; {same} of 16 rows agree"


def scored_groups(seed: int) -> list[Sample]:
    """Four groups of four samples: random prompts and responses, rewards of 0 and 1."""
    rng = random.Random(seed)
    return [
        Sample(
            f"p{i // 4}",
            i % 4,
            [rng.randrange(3, 60) for _ in range(6)],
            [rng.randrange(3, 60) for _ in range(5)],
            [-1.0] * 5,
            [1] * 5,
            "stop",
            0,
            "",
            {},
            float(i % 3 == 0),
        )
        for i in range(16)
    ]


def test_trainer_on_cuda_takes_the_cpu_step(policy_dir):
    samples = scored_groups(0)
    fns = bind(rollout=RolloutConfig(n_samples=4, temperature=1.0))
    metrics, logprobs = {}, {}
    for device in ("cpu", "cuda"):
        trainer = TorchTrainer.from_hf(policy_dir, TrainConfig(lr=1e-3, mtp_lr=1e-3, micro_batch_size=4), device=device)
        metrics[device] = optimize(trainer, samples, fns, 0)
        logprobs[device] = trainer.logprobs(pack(samples, pad_id=0), temperature=1.0)
    assert logprobs["cuda"].device.type == "cpu"
    torch.testing.assert_close(logprobs["cuda"], logprobs["cpu"], atol=1e-4, rtol=1e-4)
    for key in ("train/loss", "train/grad_norm", "train/mtp_loss"):
        assert metrics["cuda"][key] == pytest.approx(metrics["cpu"][key], rel=1e-3, abs=1e-5), key


def test_a_recipe_with_train_gpus_trains_its_stage_on_the_gpu(policy_dir, tmp_path):
    """The train stage of a recipe with train.gpus_per_node (convert, train, publish as the tasks run them) computes on
    the GPU, takes the CPU's step and leaves a checkpoint the CPU-only publish reads."""
    from miles_core.config import AlgoConfig, PublishConfig
    from miles_core.train.backends import convert_checkpoint, export_policy, load_trainer, train_checkpoint

    samples = scored_groups(1)
    fns = bind(rollout=RolloutConfig(n_samples=4, temperature=1.0))
    losses = {}
    for gpus in (0, 1):
        cfg = TrainConfig(lr=1e-3, micro_batch_size=4, nproc_per_node=1, gpus_per_node=gpus)
        convert_checkpoint(cfg, AlgoConfig(), policy_dir, tmp_path / f"c{gpus}")
        assert load_trainer(cfg, str(tmp_path / f"c{gpus}")).device.type == ("cuda" if gpus else "cpu")
        _, metrics = train_checkpoint(cfg, fns, str(tmp_path / f"c{gpus}"), samples, policy_dir, tmp_path / f"t{gpus}", 0)
        losses[gpus] = metrics["train/loss"]
        export_policy(cfg, str(tmp_path / f"t{gpus}"), tmp_path / f"p{gpus}", PublishConfig(), 1, 0)
    assert losses[1] == pytest.approx(losses[0], rel=1e-3, abs=1e-5)
