"""Async phase vs the synchronous loop: throughput and reward on the same recipe, steps and machine.
Prints one JSON object.

Both start from the same SFT policy and checkpoint (built by the workflow's own tasks, locally)
and train the same number of steps on the same number of samples:
* sync: rollout -> score -> train -> weights into the engine, in one process, one after another
  (the looped DAG's compute without its per-task overhead: the fairest sync baseline);
* async: `run_phase` on a local Ray cluster: rollout actors generate while the trainer trains.
Throughput is consumed samples (and their response tokens) per second over the training run,
from the first rollout to the end of the last step; start-up (sync: engine and trainer loading;
async: starting the Ray actors) is reported apart, as is the async phase's whole wall time. Rollout
actors start generating while the trainer actor loads, so the async run may begin with up to
`queue_size` groups ready: use K well above queue_size / prompts_per_step. The reward is the mean
training reward of the last three steps and the held-out greedy accuracy after the last step.
Both sides use `--threads` torch threads per process (sync: one process; async: each actor).

    python bench/async_vs_sync.py [--recipe recipes/smoke_async.yaml] [--steps 8] [key=value ...]
"""

import argparse
import os
import tempfile

os.environ["HOME"] = tempfile.mkdtemp(prefix="bench-async-")  # a private Flyte cache for the preparation tasks

import dataclasses
import statistics
import time
from pathlib import Path

import ray
import torch
import yaml
from measure import emit
from transformers import AutoTokenizer

from miles_core.async_loop import PhaseSpec, run_phase
from miles_core.config import load_recipe
from miles_core.data.source import DataState, load_prompts
from miles_core.plugins import plugin
from miles_core.rollout.engines import make_engine
from miles_core.step import bind, run_step
from miles_core.step import evaluate as evaluate_policy
from miles_core.train.torch_backend import TorchTrainer
from tasks.prepare import admit_model, base_model, make_data
from tasks.rl import convert
from tasks.sft import sft

REPO = Path(__file__).resolve().parents[1]


def prepare(cfg):
    base = admit_model(base=base_model(cfg=cfg.model, root=cfg.run_root), train=cfg.train)
    dataset = make_data(cfg=cfg.data, root=cfg.run_root)
    start = sft(cfg=cfg.sft, data=cfg.data, base=base, dataset=dataset, root=cfg.run_root)
    ckpt = convert(cfg=cfg.train, algo=cfg.algo, policy=start, root=cfg.run_root)
    return start, dataset, ckpt


def run_sync(cfg, start, prompts, ckpt_dir: str, steps: int, threads: int):
    torch.set_num_threads(threads)
    started = time.perf_counter()
    engine = make_engine(cfg.rollout, start.dir.path, start.version, num_threads=threads)
    trainer, tokenizer = TorchTrainer.load(ckpt_dir, cfg.train), AutoTokenizer.from_pretrained(ckpt_dir)
    source = plugin(cfg.data, "data", "source_fn")(prompts, cfg.data.seed, DataState())
    fns = bind(rollout=cfg.rollout, reward=cfg.reward, algo=cfg.algo, hooks=cfg.hooks, evaluation=cfg.evaluation)
    ready, consumed, rewards = time.perf_counter(), [], []
    for step in range(steps):
        samples, _, metrics = run_step(engine, source, tokenizer, fns, trainer, [], step)
        rewards.append(metrics["reward/mean"])
        engine.load_state_dict(trainer.model.state_dict(), start.version + step + 1)
        consumed.append(samples)
    return summary(consumed, rewards, ready - started, time.perf_counter() - ready), engine


def run_async(cfg, start, prompts, ckpt_dir: str, steps: int, out: str):
    spec = PhaseSpec(
        cfg=cfg.async_phase,
        rollout=cfg.rollout,
        reward=cfg.reward,
        algo=cfg.algo,
        train=cfg.train,
        hooks=cfg.hooks,
        health=cfg.health,
        publish=cfg.publish,
        source_fn=plugin(cfg.data, "data", "source_fn"),
        seed=cfg.data.seed,
        prompts=prompts,
        state=DataState(),
        waiting=[],
        ckpt_dir=ckpt_dir,
        policy_dir=start.dir.path,
        version=start.version,
        reference_dir=start.dir.path,
        first_iteration=0,
        steps=steps,
    )
    result = run_phase(spec, out)
    m = result.metrics
    out_summary = summary(result.consumed, [s["reward/mean"] for s in result.steps], m["time/async_startup_s"], m["time/async_train_s"])
    out_summary.update({k.split("/")[1]: round(v, 3) for k, v in m.items() if k.startswith("async/") and "_per_s" not in k})
    out_summary["phase_wall_s"] = round(m["time/async_phase_s"], 1)  # start-up + run + finishing (buffer drained, checkpoint saved)
    return out_summary, make_engine(cfg.rollout, out, start.version + steps, num_threads=2)


def summary(consumed, rewards, startup_s: float, run_s: float) -> dict:
    """Throughput over the training run (first rollout to last step), start-up apart."""
    samples = sum(len(b) for b in consumed)
    tokens = sum(len(s.response_tokens) for b in consumed for s in b)
    return {
        "samples_per_s": round(samples / run_s, 2),
        "tokens_per_s": round(tokens / run_s, 1),
        "run_s": round(run_s, 2),
        "startup_s": round(startup_s, 1),
        "samples": samples,
        "final_reward": round(statistics.fmean(rewards[-3:]), 3),
    }


def held_out(cfg, engine, dataset, tokenizer) -> float:
    prompts = load_prompts(dataset.test.path, cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key)
    return round(evaluate_policy(engine, prompts, tokenizer, bind(rollout=cfg.rollout, reward=cfg.reward, evaluation=cfg.evaluation))["eval/accuracy"], 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/smoke_async.yaml")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    args = parser.parse_args()
    root = Path(os.environ["HOME"]) / "runs"
    overrides = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    cfg = dataclasses.replace(load_recipe(REPO / args.recipe, overrides), run_root=str(root))
    load_before = os.getloadavg()[0]
    start, dataset, ckpt = prepare(cfg)
    prompts = load_prompts(dataset.train.path, cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key)
    tokenizer = AutoTokenizer.from_pretrained(start.dir.path)
    cfg = dataclasses.replace(cfg, async_phase=dataclasses.replace(cfg.async_phase, threads_per_actor=args.threads))
    sync, sync_engine = run_sync(cfg, start, prompts, ckpt.dir.path, args.steps, args.threads)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    async_, async_engine = run_async(cfg, start, prompts, ckpt.dir.path, args.steps, str(root / "async-ckpt"))
    ray.shutdown()
    sync["held_out_accuracy"], async_["held_out_accuracy"] = held_out(cfg, sync_engine, dataset, tokenizer), held_out(cfg, async_engine, dataset, tokenizer)
    emit(
        {
            "bench": "async_vs_sync",
            "recipe": args.recipe,
            "steps": args.steps,
            "overrides": args.overrides,
            "threads_per_process": args.threads,
            "rollout_workers": cfg.async_phase.rollout_workers,
            "cores": os.cpu_count(),
            "sync": sync,
            "async": async_,
            "ratio_samples_per_s": round(async_["samples_per_s"] / sync["samples_per_s"], 2),
            "ratio_tokens_per_s": round(async_["tokens_per_s"] / sync["tokens_per_s"], 2),
            "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        }
    )


if __name__ == "__main__":
    main()
