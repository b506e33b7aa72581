"""Trainer throughput and model FLOPs utilisation: GRPO steps of the torch backend on a Qwen2 model of ~12.6M
parameters (built locally), in float32 and in bfloat16 (train.dtype), against the matmul peak measured in the same
run. Prints one JSON object.

One GRPO step = the old-log-prob recompute (a forward pass) + forward/backward of the loss + AdamW. Its model FLOPs,
counted analytically over the T real tokens of sequences of length S (matrix products only, as in PaLM's MFU):
    forward     = 2 (N - H) T + 2 H R + 4 n_layers d S T
                  (N: parameters, the tied embedding counted once as the output projection H = d_model x vocab,
                   which the trainer computes only at the R positions before response tokens; 4 n_layers d S T: the
                   attention scores and their weighted sum, d = heads x head_dim, not halved for causality)
    step FLOPs  = 4 x forward                  (recompute 1x, forward + backward 3x)
Every sample has a prompt of its own, so the trainer computes every token of every sample (no group's prompt computed
once, miles_core/train/prefix.py): the FLOPs counted are the FLOPs done.
MFU = step FLOPs / step time / peak, the peak per dtype the best of a few large square torch.mm in that dtype.
`shared_prompts`: the same step on groups sharing their prompt, as a rollout makes them, packed (each group's prompt
computed once) against every sample in its own row.

python bench/trainer.py [--sequences 128] [--steps 3] [--dtypes float32,bfloat16]
python bench/trainer.py --device cuda --hidden 2048 --layers 16 --sequences 256 --micro-batch-size 64 --prompt-len 192 --response-len 64
"""

import argparse
import dataclasses
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout without the project installed (a GPU machine)

import miles_core  # noqa: E402, F401  first: its thread policy (miles_core/cpus.py) is in place before torch starts OpenMP

# isort: split
import torch  # noqa: E402
from measure import emit, synchronize  # noqa: E402

from miles_core.config import ModelConfig, RolloutConfig, TrainConfig  # noqa: E402
from miles_core.models.tiny import build_tiny_model  # noqa: E402
from miles_core.samples import Sample  # noqa: E402
from miles_core.step import bind, optimize  # noqa: E402
from miles_core.train.torch_backend import TorchTrainer  # noqa: E402

MODEL = ModelConfig(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1536)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def batch(n: int, group: int, rng: random.Random, prompt_len: int = 14, response_len: int = 4, shared: bool = False) -> list[Sample]:
    """Addition-shaped samples (by default 14 prompt tokens, 4 response tokens), binary rewards; each with a prompt of
    its own, or (`shared`) one prompt per group of `group`, as a rollout makes them."""
    prompts = [[rng.randrange(3, 300) for _ in range(prompt_len)] for _ in range(-(-n // group))]
    return [
        Sample(
            f"p{i // group}",
            i % group,
            prompts[i // group] if shared else [rng.randrange(3, 300) for _ in range(prompt_len)],
            [rng.randrange(3, 300) for _ in range(response_len - 1)] + [2],
            [-1.0] * response_len,
            [1] * response_len,
            "stop",
            0,
            "",
            {},
            float(rng.random() < 0.5),
        )
        for i in range(n)
    ]


def matmul_peak(dtype: torch.dtype, device: torch.device, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `repeats` square torch.mm per size, in `dtype` (sizes 1024, 2048; 4096, 8192 on a GPU)."""
    best = 0.0
    for n in (1024, 2048) if device.type == "cpu" else (4096, 8192):
        a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
        torch.mm(a, b)
        for _ in range(repeats):
            synchronize(device)
            started = time.perf_counter()
            torch.mm(a, b)
            synchronize(device)
            best = max(best, 2 * n**3 / (time.perf_counter() - started))
    return best


def step_flops(model: torch.nn.Module, samples: list[Sample]) -> float:
    """The model FLOPs of one GRPO step on `samples` (module docstring)."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    head = model.get_output_embeddings().weight.numel()
    attention = 0
    for s in samples:
        length = len(s.prompt_tokens) + len(s.response_tokens)
        attention += 4 * cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) * length * length
    tokens = sum(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
    responses = sum(len(s.response_tokens) for s in samples)
    return 4 * (2 * (params - head) * tokens + 2 * head * responses + attention)


def time_steps(trainer: TorchTrainer, samples: list[Sample], group: int, steps: int) -> list[float]:
    """Seconds of each of `steps` GRPO steps after one warm-up step."""
    fns = bind(rollout=RolloutConfig(n_samples=group, temperature=1.0))
    optimize(trainer, samples, fns, 0)
    times = []
    for _ in range(steps):
        synchronize(trainer.device)
        started = time.perf_counter()
        optimize(trainer, samples, fns, 0)
        synchronize(trainer.device)
        times.append(time.perf_counter() - started)
    return times


def shared_prompts(model_dir: str, args: argparse.Namespace) -> dict:
    """GRPO steps (fp32) on groups of `--group` samples sharing their prompt, as a rollout makes them: each group's
    prompt computed once (miles_core/train/prefix.py) against every sample in its own row, the same trainer and batch."""
    samples = batch(args.sequences, args.group, random.Random(0), args.prompt_len, args.response_len, shared=True)
    trainer = TorchTrainer.from_hf(model_dir, TrainConfig(micro_batch_size=args.micro_batch_size), device=args.device)
    packed = min(time_steps(trainer, samples, args.group, args.steps))
    trainer._prefix_cost = None  # every sample in its own row
    apart = min(time_steps(trainer, samples, args.group, args.steps))
    return {"group": args.group, "step_s_packed": round(packed, 4), "step_s_rows_apart": round(apart, 4), "speedup": round(apart / packed, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--response-len", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=TrainConfig.micro_batch_size)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, ...")
    parser.add_argument("--hidden", type=int, default=MODEL.hidden_size, help="hidden size (heads of 64, 3x MLP, kv heads half)")
    parser.add_argument("--layers", type=int, default=MODEL.num_layers)
    args = parser.parse_args()
    model = dataclasses.replace(
        MODEL, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64, num_kv_heads=args.hidden // 128, intermediate_size=3 * args.hidden
    )
    device = torch.device(args.device)
    samples = batch(args.sequences, args.group, random.Random(0), args.prompt_len, args.response_len)
    tokens = sum(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(model, f"{tmp}/m")
        for name in args.dtypes.split(","):
            trainer = TorchTrainer.from_hf(model_dir, TrainConfig(dtype=name, micro_batch_size=args.micro_batch_size), device=args.device)
            flops = step_flops(trainer.model, samples)
            times = time_steps(trainer, samples, args.group, args.steps)
            peak = matmul_peak(DTYPES[name], device)
            achieved = flops / min(times)
            results[name] = {
                "step_s_best": round(min(times), 4),
                "step_s_median": round(sorted(times)[len(times) // 2], 4),
                "tokens_per_s": round(tokens / min(times), 1),
                "achieved_gflops": round(achieved / 1e9, 1),
                "matmul_peak_gflops": round(peak / 1e9, 1),
                "mfu": round(achieved / peak, 4),
            }
        packing = shared_prompts(model_dir, args)
    emit(
        {
            "bench": "trainer",
            "backend": "torch",
            "model": {**dataclasses.asdict(model), "parameters": sum(p.numel() for p in trainer.model.parameters())},
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "sequences": args.sequences,
            "sequence_len": args.prompt_len + args.response_len,
            "tokens_per_step": tokens,
            "micro_batch_size": args.micro_batch_size,
            "step_gflops": round(flops / 1e9, 2),
            "dtypes": results,
            "mfu_goal_of_bf16_peak": 0.35,
            "torch_threads": torch.get_num_threads(),
            "shared_prompts": packing,
            "flops_formula": "4 x (2 (N - H) T + 2 H R + 4 n_layers d S T): recompute forward + forward/backward, matrix products only, the output head H at the R positions before response tokens",
        }
    )


if __name__ == "__main__":
    main()
