"""Async phase vs the synchronous loop: throughput and reward on the same recipe, steps and machine.
Prints one JSON object.

Both start from the same SFT policy and checkpoint (built by the workflow's own tasks, locally)
and train the same number of steps on the same number of samples:
* sync: rollout -> score -> train -> weights into the engine, in one process, one after another
  (the looped DAG's compute without its per-task overhead: the fairest sync baseline);
* async: `run_phase` on a local Ray cluster: rollout actors generate while the trainer trains.
Throughput is consumed samples (and their response tokens) per second of wall time, over all
steps (async: including the actors' start-up) and in steady state (steps 2..K). The reward is the
mean training reward of the last steps and the held-out greedy accuracy after the last step.

    python bench/async_vs_sync.py [--recipe recipes/smoke_async.yaml] [--steps 8] [key=value ...]
"""

import argparse
import os
import tempfile

os.environ["HOME"] = tempfile.mkdtemp(prefix="bench-async-")  # a private Flyte cache for the preparation tasks

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from miles_core import loop  # noqa: E402
from miles_core.async_loop import PhaseSpec, load_in_memory, make_engine, run_phase  # noqa: E402
from miles_core.config import load_recipe  # noqa: E402
from miles_core.data.source import DataState, load_prompts  # noqa: E402
from miles_core.plugins import plugin  # noqa: E402
from miles_core.train.torch_backend import TorchTrainer  # noqa: E402
from tasks.prepare import build_model, make_data  # noqa: E402
from tasks.rl import convert  # noqa: E402
from tasks.sft import sft  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def prepare(cfg):
    base = build_model(cfg=cfg.model, root=cfg.run_root)
    dataset = make_data(cfg=cfg.data, root=cfg.run_root)
    start = sft(cfg=cfg.sft, data=cfg.data, base=base, dataset=dataset, root=cfg.run_root)
    ckpt = convert(cfg=cfg.train, algo=cfg.algo, policy=start, root=cfg.run_root)
    return start, dataset, ckpt


def run_sync(cfg, start, prompts, ckpt_dir: str, steps: int):
    torch.set_num_threads(2)
    engine = make_engine(cfg.rollout, start.dir.path, start.version, threads=2)
    trainer, tokenizer = TorchTrainer.load(ckpt_dir, cfg.train), AutoTokenizer.from_pretrained(ckpt_dir)
    source = plugin(cfg.data, "data", "source_fn")(prompts, cfg.data.seed, DataState())
    scorer = functools.partial(loop.score, reward_fn=plugin(cfg.reward, "reward", "fn"), tokenizer=tokenizer, cfg=cfg.reward, group_size=cfg.rollout.n_samples)
    records = []
    for step in range(steps):
        started = time.perf_counter()
        samples, _, _ = loop.rollout(engine, source, tokenizer, cfg.rollout, scorer, [], cfg.rollout.seed * 1_000_003 + step)
        metrics = scorer(samples)
        loop.train(trainer, samples, cfg.algo, cfg.rollout.n_samples, cfg.rollout.temperature, tokenizer.pad_token_id, horizon=cfg.rollout.max_new_tokens)
        load_in_memory(engine, trainer.model.state_dict(), start.version + step + 1)
        records.append((time.perf_counter() - started, len(samples), sum(len(s.response_tokens) for s in samples), metrics["reward/mean"]))
    return records, engine


def run_async(cfg, start, prompts, ckpt_dir: str, steps: int, out: str):
    spec = PhaseSpec(
        cfg=cfg.async_phase, rollout=cfg.rollout, reward=cfg.reward, algo=cfg.algo, train=cfg.train, hooks=cfg.hooks,
        source_fn=plugin(cfg.data, "data", "source_fn"), seed=cfg.data.seed, prompts=prompts, state=DataState(), waiting=[],
        ckpt_dir=ckpt_dir, policy_dir=start.dir.path, version=start.version, reference_dir=start.dir.path, first_iteration=0, steps=steps,
    )
    started = time.perf_counter()
    result = run_phase(spec, out)
    wall = time.perf_counter() - started
    records = [(m["async/trainer_idle_s"] + m["time/train_s"] + m["async/weight_push_s"], len(b), sum(len(s.response_tokens) for s in b), m["reward/mean"])
               for m, b in zip(result.steps, result.consumed)]
    engine = make_engine(cfg.rollout, out, start.version + steps, threads=2)
    return records, wall, result.metrics, engine


def throughput(records, wall=None) -> dict:
    steady = records[1:]
    seconds = sum(r[0] for r in steady)
    total = wall if wall is not None else sum(r[0] for r in records)
    return {
        "samples_per_s": round(sum(r[1] for r in records) / total, 2), "tokens_per_s": round(sum(r[2] for r in records) / total, 1),
        "steady_samples_per_s": round(sum(r[1] for r in steady) / seconds, 2), "steady_tokens_per_s": round(sum(r[2] for r in steady) / seconds, 1),
        "final_reward": round(statistics.fmean(r[3] for r in records[-3:]), 3), "samples": sum(r[1] for r in records), "wall_s": round(total, 1),
    }


def held_out(cfg, engine, dataset, tokenizer) -> float:
    prompts = load_prompts(dataset.test.path, cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key)
    return round(loop.evaluate(engine, prompts, tokenizer, plugin(cfg.reward, "reward", "fn"), cfg.reward, cfg.evaluation)["eval/accuracy"], 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/smoke_async.yaml")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    args = parser.parse_args()
    root = Path(os.environ["HOME"]) / "runs"
    overrides = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    cfg = dataclasses.replace(load_recipe(REPO / args.recipe, overrides), run_root=str(root))
    load_before = os.getloadavg()[0]
    start, dataset, ckpt = prepare(cfg)
    prompts = load_prompts(dataset.train.path, cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key)
    tokenizer = AutoTokenizer.from_pretrained(start.dir.path)
    sync_records, sync_engine = run_sync(cfg, start, prompts, ckpt.dir.path, args.steps)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    async_records, wall, metrics, async_engine = run_async(cfg, start, prompts, ckpt.dir.path, args.steps, str(root / "async-ckpt"))
    ray.shutdown()
    sync, async_ = throughput(sync_records), throughput(async_records, wall)
    sync["held_out_accuracy"], async_["held_out_accuracy"] = held_out(cfg, sync_engine, dataset, tokenizer), held_out(cfg, async_engine, dataset, tokenizer)
    async_.update({k.split("/")[1]: round(v, 3) for k, v in metrics.items() if k.startswith("async/staleness") or k in ("async/queue_depth_mean", "async/rollout_idle_s", "async/dropped_samples")})
    print(json.dumps({
        "bench": "async_vs_sync", "recipe": args.recipe, "steps": args.steps, "overrides": args.overrides,
        "rollout_workers": cfg.async_phase.rollout_workers, "cores": os.cpu_count(),
        "sync": sync, "async": async_,
        "ratio_samples_per_s": round(async_["samples_per_s"] / sync["samples_per_s"], 2),
        "ratio_steady_samples_per_s": round(async_["steady_samples_per_s"] / sync["steady_samples_per_s"], 2),
        "ratio_steady_tokens_per_s": round(async_["steady_tokens_per_s"] / sync["steady_tokens_per_s"], 2),
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }))


if __name__ == "__main__":
    main()
