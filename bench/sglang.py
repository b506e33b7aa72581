"""SGLang on CPU versus the embedded torch engine versus HF `generate`, and weight-update cost.

All three generate from the same tiny random Qwen2 (built here, no hub) for the same prompts,
sampling at temperature 1, top_k=0 (HF's default would be 50), top_p=1, --new-tokens per sequence
(SGLang also stops at the model's EOS, so tokens are counted as generated). Best of --repeats
after a warm-up, runs alternated so other load hits all alike. Then the two ways of publishing
weights into the running server, each timed end to end (pause, begin, update, end, flush,
continue): from the published directory on disk, and broadcast over a gloo process group from
tensors in this process. Needs `make sglang-env`. Prints one JSON object.

    .venv/bin/python bench/sglang.py [--batch 256 --n 4 --prompt-len 16 --new-tokens 32 --repeats 3]
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
from rollout import best_times, build_model_dir  # noqa: E402  (bench/rollout.py: same model, same timing)
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from miles_core.config import SGLangConfig  # noqa: E402
from miles_core.rollout.base import SamplingParams  # noqa: E402
from miles_core.rollout.engines.sglang import SGLangEngine  # noqa: E402
from miles_core.rollout.engines.torch_engine import TorchEngine  # noqa: E402
from miles_core.weights.sync import iter_buckets  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="sequences per batch (prompts x n)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--updates", type=int, default=3, help="weight updates timed per path (best kept)")
    return parser.parse_args()


def time_updates(engine: SGLangEngine, policy_dir: str, tensors: dict, updates: int) -> dict[str, float]:
    """Best seconds of each publishing path (versions alternate so no update is a no-op)."""
    best = {"disk": float("inf"), "distributed": float("inf")}
    version = 100
    for _ in range(updates):
        version += 1
        started = time.perf_counter()
        engine.load_weights(policy_dir, version)  # the engine's weight_sync is "disk"
        best["disk"] = min(best["disk"], time.perf_counter() - started)
        version += 1
        started = time.perf_counter()
        engine.update_weights_from_tensors(tensors.items(), version)
        best["distributed"] = min(best["distributed"], time.perf_counter() - started)
    return best


def main() -> None:
    args = parse_args()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    root = tempfile.mkdtemp(prefix="bench-sglang-")
    policy_dir = build_model_dir(args, root)
    torch_engine = TorchEngine(policy_dir, max_batch_sequences=args.batch)
    hf_model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    engine = SGLangEngine(SGLangConfig(startup_timeout_s=900, max_batch_sequences=args.batch, max_concurrency=1), policy_dir, 0)
    try:
        generator = torch.Generator().manual_seed(1)
        prompts = torch.randint(3, args.vocab, (args.batch // args.n, args.prompt_len), generator=generator).tolist()
        params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens)
        expanded = torch.tensor([p for p in prompts for _ in range(args.n)], dtype=torch.long)  # [B, L]

        def tokens_of(rollout_engine):
            return lambda: sum(len(g.tokens) for gens in rollout_engine.generate(prompts, params) for g in gens)

        def run_hf() -> int:
            with torch.inference_mode():
                out = hf_model.generate(
                    input_ids=expanded,
                    attention_mask=torch.ones_like(expanded),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=args.new_tokens,
                    pad_token_id=0,
                )
            return out[:, expanded.shape[1] :].numel()

        best = best_times({"sglang": tokens_of(engine), "torch_engine": tokens_of(torch_engine), "hf": run_hf}, args.repeats)
        tps = {name: tokens / seconds for name, (seconds, tokens) in best.items()}
        tensors = dict(hf_model.state_dict())
        megabytes = sum(b.nbytes for b in iter_buckets(tensors.items(), 1 << 40)) / 2**20
        updates = time_updates(engine, policy_dir, tensors, args.updates)
    finally:
        engine.close()
    emit(
        {
            "sglang_tokens_per_s": round(tps["sglang"], 1),
            "torch_engine_tokens_per_s": round(tps["torch_engine"], 1),
            "hf_generate_tokens_per_s": round(tps["hf"], 1),
            "ratio_sglang_over_torch_engine": round(tps["sglang"] / tps["torch_engine"], 3),
            "ratio_sglang_over_hf": round(tps["sglang"] / tps["hf"], 3),
            "weights_mb": round(megabytes, 2),
            "update_from_disk_s_per_mb": round(updates["disk"] / megabytes, 5),
            "update_distributed_s_per_mb": round(updates["distributed"] / megabytes, 5),
            "ratio_distributed_over_disk": round(updates["distributed"] / updates["disk"], 3),
            **{name: getattr(args, name) for name in ("batch", "n", "prompt_len", "new_tokens", "vocab", "repeats")},
            "torch_threads": torch.get_num_threads(),
            "load_average_1m": round(os.getloadavg()[0], 2),
        }
    )


if __name__ == "__main__":
    main()
