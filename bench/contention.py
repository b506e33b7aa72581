"""Contention: SFT and RL (GRPO train) steps/s of the torch trainer on the default tiny model, idle and with one
competing CPU-bound process, before (torch's default threads, OpenMP's default wait policy) and after the project's
thread policy (miles_core/cpus.py: threads from the CPUs the process may use, waiting threads sleep). Each side runs in
a fresh process (OpenMP reads its settings once, at start), all in one run. Prints one JSON object.

python bench/contention.py [--seconds 6]
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch  # before miles_core: the "before" side must start OpenMP with the environment it was given
from measure import emit
from trainer import batch

from miles_core.algos.objective import sft_loss
from miles_core.config import ModelConfig, RolloutConfig, SFTConfig, TrainConfig
from miles_core.cpus import thread_environment
from miles_core.models.tiny import build_tiny_model
from miles_core.step import bind, optimize
from miles_core.train.base import pack
from miles_core.train.torch_backend import TorchTrainer

COMPETITOR = "while True: pass"  # one CPU-bound process


def steps_per_s(step, seconds: float) -> float:
    """Steps per second of `step()` over about `seconds`, after one warm-up step."""
    step()
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        step()
        count += 1
    return count / (time.perf_counter() - started)


def worker(seconds: float) -> dict:
    """SFT and GRPO steps/s in this process, as its environment set it up."""
    samples = batch(SFTConfig.batch_size, 8, random.Random(0))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(ModelConfig(), f"{tmp}/m")
        trainer = TorchTrainer.from_hf(model_dir, TrainConfig(micro_batch_size=SFTConfig.batch_size))
        packed = pack(samples, 0)
        sft = steps_per_s(lambda: trainer.train_on(packed, {}, sft_loss, temperature=1.0), seconds)
        fns = bind(rollout=RolloutConfig(n_samples=8, temperature=1.0))
        rl = steps_per_s(lambda: optimize(trainer, samples, fns, 0), seconds)
    return {"sft_steps_per_s": round(sft, 2), "rl_steps_per_s": round(rl, 2), "torch_threads": torch.get_num_threads()}


def measure(env: dict, loaded: bool, seconds: float) -> dict:
    competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR]) if loaded else None
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", "--seconds", str(seconds)], env=env, capture_output=True, text=True, check=True)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.seconds)))
        return
    policy = thread_environment()
    default = {k: v for k, v in os.environ.items() if k not in policy}
    sides = {"before": default, "after": {**default, **policy}}
    results = {name: {load: measure(env, load == "loaded", args.seconds) for load in ("idle", "loaded")} for name, env in sides.items()}
    for side in results.values():
        for key in ("sft_steps_per_s", "rl_steps_per_s"):
            side[f"{key.split('_')[0]}_loaded_over_idle"] = round(side["loaded"][key] / side["idle"][key], 3)
    emit({"bench": "contention", "competitor": COMPETITOR, "policy": policy, "goal_loaded_over_idle": 0.6, "load_average_1m": os.getloadavg()[0], **results})


if __name__ == "__main__":
    main()
