"""Megatron backend vs torch backend: one GRPO step on the same tiny model and batch. Prints one JSON object.

    python bench/megatron.py [--sequences 256] [--steps 5]

Runs the torch backend (1 process), then the megatron backend in 1 process, 2 processes with data
parallel 2 and 2 processes with tensor parallel 2 (torchrun, gloo, 1 thread per process), each
timing `step.optimize` (old-logprob recompute + forward/backward + optimizer step) after a warm-up.
The torch backend has no multi-process mode, so the 2-process ratios compare against it in 1 process.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo, not bench/ (whose megatron.py would shadow megatron-core)
sys.path.append(str(Path(__file__).parent))  # bench/measure.py, after site-packages: megatron-core, not this file, is `megatron`

from measure import emit  # noqa: E402

from bench.trainer import batch  # noqa: E402
from miles_core.config import ModelConfig, RolloutConfig, TrainConfig  # noqa: E402
from miles_core.models.tiny import build_tiny_model  # noqa: E402
from miles_core.step import bind, optimize  # noqa: E402


def time_steps(trainer, sequences: int, group: int, steps: int) -> dict:
    samples = batch(sequences, group, random.Random(0))
    tokens = sum(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
    optimize(trainer, samples, bind(rollout=RolloutConfig(n_samples=group, temperature=1.0)), 0)  # warm-up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        optimize(trainer, samples, bind(rollout=RolloutConfig(n_samples=group, temperature=1.0)), 0)
        times.append(time.perf_counter() - started)
    best = min(times)
    return {
        "step_s_best": round(best, 4),
        "step_s_median": round(sorted(times)[len(times) // 2], 4),
        "tokens_per_s": round(tokens / best, 1),
        "tokens_per_step": tokens,
    }


def megatron_worker(model_dir: str, tp: int, sequences: int, group: int, steps: int) -> None:
    from miles_core.train.megatron.trainer import MegatronTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = TrainConfig(backend="megatron", tensor_parallel=tp, nproc_per_node=world)
    result = time_steps(MegatronTrainer.from_hf(model_dir, cfg), sequences, group, steps)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)


def run_megatron(model_dir: str, nproc: int, tp: int, args) -> dict:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else [sys.executable]
    command = [*launcher, __file__, "--worker", model_dir, "--tp", str(tp), "--sequences", str(args.sequences), "--steps", str(args.steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else str(torch.get_num_threads()), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--worker")
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    if args.worker:
        return megatron_worker(args.worker, args.tp, args.sequences, args.group, args.steps)
    from miles_core.train.torch_backend import TorchTrainer

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(ModelConfig(), f"{tmp}/m")
        torch_1 = time_steps(TorchTrainer.from_hf(model_dir, TrainConfig()), args.sequences, args.group, args.steps)
        runs = {
            "megatron_1proc": run_megatron(model_dir, 1, 1, args),
            "megatron_2proc_dp2": run_megatron(model_dir, 2, 1, args),
            "megatron_2proc_tp2": run_megatron(model_dir, 2, 2, args),
        }
    emit(
        {
            "bench": "megatron",
            "model": "tiny qwen2 (hidden 128, 4 layers)",
            "sequences": args.sequences,
            "torch_1proc": torch_1,
            **runs,
            **{f"speed_ratio_{name}_vs_torch_1proc": round(run["tokens_per_s"] / torch_1["tokens_per_s"], 3) for name, run in runs.items()},
            "load_average_1min": round(os.getloadavg()[0], 2),
        }
    )


if __name__ == "__main__":
    main()
