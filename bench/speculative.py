"""Rollout throughput with and without speculative decoding by an MTP draft head, on one tiny model and prompts.

A tiny Qwen2 (built here, no hub) is trained for --policy-steps on a noisy counting language (models/counting.py), so
it is peaked but not deterministic as a policy is after RL (a random tiny model samples noise no head can predict);
a fresh MTP head is then trained for --sft-steps MTP-SFT steps (train/mtp.py) on the model's own samples at
temperature 1, and the same prompts (text of that language) are decoded by the torch engine with and without
speculation (--draft tokens per pass), greedy and sampled, at each --batch.  Best of --repeats after a warm-up.  Prints one JSON object: tokens/s of both, the speed-up
and the acceptance rate (accepted drafts / drafted) per setting, and the head's training curve.

    .venv/bin/python bench/speculative.py [--batch 1 8 --draft 3 --new-tokens 48 --policy-steps 150 --sft-steps 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from measure import emit  # noqa: E402
from transformers import Qwen2ForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from bench.rollout import bench_model  # noqa: E402
from miles_core.config import TrainConfig  # noqa: E402
from miles_core.models.counting import counting_text, train_counting  # noqa: E402
from miles_core.rollout.base import SamplingParams  # noqa: E402
from miles_core.rollout.engines.torch_engine import TorchEngine  # noqa: E402
from miles_core.rollout.speculative import acceptance_metrics  # noqa: E402
from miles_core.samples import Sample  # noqa: E402
from miles_core.train.base import pack  # noqa: E402
from miles_core.train.mtp import MtpTrainer  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="sequences decoded together")
    parser.add_argument("--draft", type=int, default=3, help="rollout.speculative_tokens")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--policy-steps", type=int, default=150, help="AdamW steps of the policy on the counting language")
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--sft-batch", type=int, default=32, help="sampled sequences per MTP-SFT step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


def build_policy(args: argparse.Namespace, root: str) -> Qwen2ForCausalLM:
    model = train_counting(bench_model(args), args.policy_steps, stop_id=0)
    model.save_pretrained(root)
    return model


def prompts(count: int, args: argparse.Namespace, seed: int) -> list[list[int]]:
    return counting_text(count, args.prompt_len, args.vocab, 0, torch.Generator().manual_seed(seed)).tolist()


def train_head(model, policy_dir: str, args: argparse.Namespace) -> list[float]:
    """MTP-SFT on fresh samples of the policy each step; saves the head beside it; returns the losses."""
    engine = TorchEngine(policy_dir, max_batch_sequences=args.sft_batch)
    mtp = MtpTrainer.for_policy(model, policy_dir, TrainConfig(mtp_lr=2e-3))
    losses = []
    for step in range(args.sft_steps):
        batch = prompts(args.sft_batch, args, seed=1000 + step)
        out = engine.generate(batch, SamplingParams(max_new_tokens=args.new_tokens // 2, seed=step))
        samples = [Sample(str(i), 0, p, g.tokens, g.logprobs, [1] * len(g.tokens), g.finish_reason, 0, "") for i, (p, [g]) in enumerate(zip(batch, out))]
        losses.append(mtp.train_on(model, pack(samples, pad_id=0))["train/mtp_loss"])
    mtp.export(policy_dir)
    return losses


def timed(engine: TorchEngine, batch: list[list[int]], params: SamplingParams, repeats: int) -> tuple[float, dict]:
    engine.generate(batch, params)  # warm-up
    best, out = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        out = engine.generate(batch, params)
        best = min(best, time.perf_counter() - started)
    tokens = sum(len(g.tokens) for group in out for g in group)
    return tokens / best, acceptance_metrics(out)


def main() -> None:
    args = parse_args()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        model = build_policy(args, root)
        started = time.perf_counter()
        losses = train_head(model, root, args)
        sft_s = time.perf_counter() - started
        results = []
        for size in args.batch:
            plain = TorchEngine(root, max_batch_sequences=size)
            spec = TorchEngine(root, max_batch_sequences=size, speculative_tokens=args.draft)
            batch = prompts(size, args, seed=7)
            for temperature in (0.0, 1.0):
                params = SamplingParams(temperature=temperature, max_new_tokens=args.new_tokens, seed=3)
                plain_tps, _ = timed(plain, batch, params, args.repeats)
                spec_tps, accepted = timed(spec, batch, params, args.repeats)
                results.append(
                    {
                        "batch": size,
                        "temperature": temperature,
                        "plain_tokens_per_s": round(plain_tps, 1),
                        "speculative_tokens_per_s": round(spec_tps, 1),
                        "speedup": round(spec_tps / plain_tps, 3),
                        "accept_rate": round(accepted["rollout/spec_accept_rate"], 3),
                    }
                )
    curve = {"first_10": sum(losses[:10]) / 10, "last_10": sum(losses[-10:]) / 10}
    emit({"args": vars(args), "sft_seconds": round(sft_s, 1), "mtp_loss": curve, "results": results})


if __name__ == "__main__":
    main()
