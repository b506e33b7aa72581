"""Rollout throughput: embedded TorchEngine (with log-probs) versus plain HF `model.generate`.

Both run on the same tiny random Qwen2 (built here, no hub) and the same left-padded batch, sampling
at temperature 1 with top_k=0 and top_p=1 and no stop tokens, so every sequence generates exactly
--new-tokens tokens. For each --batch size, best of --repeats after one warm-up each, the two sides
alternating. Prints one JSON object: one entry per batch size, and the process's peak resident memory.

    .venv/bin/python bench/rollout.py [--batch 64 256 --n 4 --prompt-len 16 --new-tokens 32 --repeats 5 --threads 1]
                                      [--device cuda --dtype bfloat16 --hidden 1024 --layers 8]

Beside the speed, each batch size reports `greedy_rows_identical`: the share of rows where the engine's greedy
tokens equal HF `generate`'s (greedy) on the same prompts, a check of the same output on any device.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from measure import emit, synchronize  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from miles_core.rollout.base import SamplingParams  # noqa: E402
from miles_core.rollout.engines.torch_engine import TorchEngine  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="sequences per batch (prompts x n), one run each")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--device", default="cpu", help="torch device of both sides: cpu, cuda, ...")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights and compute of both sides")
    args = parser.parse_args()
    if any(size % args.n for size in args.batch):
        parser.error(f"--batch ({args.batch}) must be multiples of --n ({args.n})")
    return args


def bench_model(args: argparse.Namespace) -> Qwen2ForCausalLM:
    """The benchmarks' Qwen2 of --vocab, --hidden and --layers, room for --prompt-len + --new-tokens, seeded."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=3 * args.hidden,
        max_position_embeddings=args.prompt_len + args.new_tokens + 16,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config)


def build_model_dir(args: argparse.Namespace, root: str) -> str:
    bench_model(args).save_pretrained(root)
    return root


def best_times(runs: dict, repeats: int, device: torch.device) -> dict[str, tuple[float, int]]:
    """Warm up each run once, then alternate them `repeats` times (so load from other processes
    hits both alike) -> {name: (fastest seconds, generated tokens)}."""
    for run in runs.values():
        run()
    best = {name: (float("inf"), 0) for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            synchronize(device)
            start = time.perf_counter()
            tokens = run()
            synchronize(device)
            best[name] = (min(best[name][0], time.perf_counter() - start), tokens)
    return best


def compare(engine: TorchEngine, hf_model, args: argparse.Namespace, size: int) -> dict:
    """Engine and HF generate on the same `size` sequences (size / n prompts), timed alternately -> one JSON entry."""
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, args.vocab, (size // args.n, args.prompt_len), generator=generator).tolist()
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens)

    def run_engine() -> int:
        out = engine.generate(prompts, params)
        return sum(len(g.tokens) for gens in out for g in gens)

    expanded = torch.tensor([p for p in prompts for _ in range(args.n)], dtype=torch.long, device=engine.device)  # [B, L]
    mask = torch.ones_like(expanded)

    def hf_generate(sample: bool) -> torch.Tensor:
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids=expanded,
                attention_mask=mask,
                do_sample=sample,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                pad_token_id=0,
            )
        return out[:, expanded.shape[1] :]

    greedy = engine.generate(prompts, SamplingParams(n=args.n, temperature=0.0, max_new_tokens=args.new_tokens))
    hf_greedy = hf_generate(sample=False).tolist()
    identical = sum(g.tokens == hf_greedy[i * args.n + j] for i, gens in enumerate(greedy) for j, g in enumerate(gens))
    best = best_times({"engine": run_engine, "hf": lambda: hf_generate(sample=True).numel()}, args.repeats, engine.device)
    (engine_s, engine_tokens), (hf_s, hf_tokens) = best["engine"], best["hf"]
    engine_tps, hf_tps = engine_tokens / engine_s, hf_tokens / hf_s
    return {
        "batch": size,
        "engine_tokens_per_s": round(engine_tps, 1),
        "hf_generate_tokens_per_s": round(hf_tps, 1),
        "ratio_engine_over_hf": round(engine_tps / hf_tps, 3),
        "greedy_rows_identical": round(identical / size, 3),
    }


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as root:
        policy_dir = build_model_dir(args, root)
        engine = TorchEngine(policy_dir, max_batch_sequences=max(args.batch), dtype=DTYPES[args.dtype], device=args.device)
        hf_model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=DTYPES[args.dtype]).to(args.device).eval()
    results = [compare(engine, hf_model, args, size) for size in args.batch]
    emit(
        {
            "results": results,
            "n": args.n,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "vocab": args.vocab,
            "hidden": args.hidden,
            "layers": args.layers,
            "parameters": sum(p.numel() for p in hf_model.parameters()),
            "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu",
            "dtype": args.dtype,
            "repeats": args.repeats,
            "torch_threads": torch.get_num_threads(),
        }
    )


if __name__ == "__main__":
    main()
