"""Trainer throughput: GRPO steps of the torch backend on the default tiny model. Prints one JSON object.

python bench/trainer.py [--sequences 256] [--steps 5]
"""

import argparse
import random
import tempfile
import time

import torch
from measure import emit

from miles_core.config import ModelConfig, RolloutConfig, TrainConfig
from miles_core.models.tiny import build_tiny_model
from miles_core.samples import Sample
from miles_core.step import bind, optimize
from miles_core.train.torch_backend import TorchTrainer


def batch(n: int, group: int, rng: random.Random) -> list[Sample]:
    """Addition-shaped samples: 14 prompt tokens, 4 response tokens, binary rewards."""
    return [
        Sample(
            f"p{i // group}",
            i % group,
            [rng.randrange(3, 300) for _ in range(14)],
            [rng.randrange(3, 300) for _ in range(3)] + [2],
            [-1.0] * 4,
            [1] * 4,
            "stop",
            0,
            "",
            {},
            float(rng.random() < 0.5),
        )
        for i in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = TorchTrainer.from_hf(build_tiny_model(ModelConfig(), f"{tmp}/m"), TrainConfig())
        samples = batch(args.sequences, args.group, rng)
        tokens = sum(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
        optimize(trainer, samples, bind(rollout=RolloutConfig(n_samples=args.group, temperature=1.0)), 0)  # warm-up
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            optimize(trainer, samples, bind(rollout=RolloutConfig(n_samples=args.group, temperature=1.0)), 0)
            times.append(time.perf_counter() - started)
    best = min(times)
    emit(
        {
            "bench": "trainer",
            "backend": "torch",
            "sequences": args.sequences,
            "tokens_per_step": tokens,
            "step_s_best": round(best, 4),
            "step_s_median": round(sorted(times)[len(times) // 2], 4),
            "tokens_per_s": round(tokens / best, 1),
            "torch_threads": torch.get_num_threads(),
            "note": "one GRPO step = old-logprob recompute + forward/backward + AdamW",
        }
    )


if __name__ == "__main__":
    main()
