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
`queue_size` groups ready: use K well above queue_size / prompts_per_step. Both sides train on the
same number of samples (`trained_samples`; the bench fails if they differ). The reward is the mean
training reward (last three steps, and by quarter of the run) and the greedy accuracy on the
recipe's held-out prompts after the last step, with its standard error over those prompts; the
SFT start's held-out accuracy is the baseline. The smoke recipe has 32 held-out prompts (its
one-digit problem set has 81 problems in all): too few to tell two policies apart by a few points;
the 2-digit recipes have 256. Both sides use `--threads` torch threads per process (sync: one
process; async: each actor). `--work-dir DIR` keeps the preparation tasks' Flyte cache (base
model, data, SFT) in DIR, so a second run with the same recipe starts from there.

    python bench/async_vs_sync.py [--recipe recipes/smoke_async.yaml] [--steps 16] [--remote-reward-delay LOW HIGH] [--work-dir DIR] [key=value ...]

With `--remote-reward-delay LOW HIGH`, both sides score through a reward model on loopback
(bench/reward_server.py, its own process) that answers each request with the recipe's own reward.fn
after LOW to HIGH seconds (uniform, seeded by the request): the recipe's reward.fn becomes
`miles_core.rewards.hub:remote`, the path a recipe with a remote reward model takes, so rewards are
the local ones and only their wait differs. Each process keeps at most reward.remote_concurrency
requests in flight (a recipe key, `reward.remote_concurrency=N` on the command line; the same on
both sides): the sync loop scores a step's batch at once (`step.score`); each rollout actor scores
its leases in threads while it generates the next, holding enough leases to fill its slots
(`async_rollout.scoring_leases`). The reward-bound case (a reward model answering in 50-200 ms) is

    python bench/async_vs_sync.py --steps 32 --remote-reward-delay 0.05 0.2 async_phase.prompts_per_lease=2 async_phase.max_staleness=2

(a lease of 2 prompts x 4 samples fits the 8 request slots of an actor, so a lease waits about one
round trip; a round trip is about a training step here, so max_staleness 2 keeps those samples).
Its async side is bounded by its requests in flight, 8 per rollout actor, against the sync loop's
one batch at 8 at a time: with 2 actors, about twice the sync loop's. The same case on the 2-digit
problem set, whose 256 held-out prompts tell the rewards apart (SFT from the recipe's own steps
takes minutes here: use --work-dir to run it again):

    python bench/async_vs_sync.py --recipe recipes/tiny_arith_async.yaml --steps 32 --remote-reward-delay 0.05 0.2 sft.steps=1000 rollout.prompts_per_step=16 rollout.n_samples=8 async_phase.rollout_workers=2 async_phase.worker_cpus=0.5 async_phase.prompts_per_lease=4 async_phase.queue_size=32 reward.remote_concurrency=32

JSON fields. `sync` / `async`: samples_per_s and tokens_per_s (consumed, over run_s), run_s,
startup_s, samples, final_reward (mean training reward of the last 3 steps), reward_by_quarter,
reward_failures (trained samples whose reward request failed and scored reward.fallback),
behaviour_kl (mean over steps of mismatch/kl_rollout_train: how far the trainer's policy at the
step's start was from the policies that generated its samples; about 0 in the sync loop),
held_out_accuracy and held_out_accuracy_se (greedy, on the held-out prompts, scored the same way),
stage_s_per_step (sync: mean seconds per
step of generation `rollout`, reward wait `score` and `train`, one after another; async: the
trainer's `train`, `weight_push` and `trainer_idle` (waiting for samples) per step, and the rollout
actors' `rollout_generate` and `rollout_score` seconds per step's worth of samples, summed over the
actors, which work side by side); async also has the phase's own async/ metrics (queue depth,
staleness fractions, dropped_samples: generated but too stale to train on, rollout busy/score/idle
seconds summed over actors) and phase_wall_s. `trained_samples`, `held_out_prompts`,
`start_held_out_accuracy`: see above. `ratio_samples_per_s` / `ratio_tokens_per_s`: async
over sync. `bound_by`: for each side, the stage that limits its throughput, derived from those
stage times (async: the trainer when it hardly waits for samples, else the rollout actors' supply
and which of reward wait or generation dominates it), with the reward requests each side may have
in flight. `remote_reward_delay_s`, `remote_concurrency`: the reward model's delay range and
requests in flight per process (null without a remote reward). Also the recipe, steps, overrides,
threads, rollout actors, cores, load average before and after, and peak memory.
"""

import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch
import yaml
from measure import emit
from reward_server import serving
from transformers import AutoTokenizer

from miles_core.async_loop import PhaseSpec, run_phase
from miles_core.config import load_recipe
from miles_core.data.source import DataState, load_prompts
from miles_core.plugins import plugin
from miles_core.rollout.engines import make_engine
from miles_core.step import bind, run_step
from miles_core.step import evaluate as evaluate_policy
from miles_core.train.torch_backend import TorchTrainer

REPO = Path(__file__).resolve().parents[1]


def prepare(cfg):
    """The workflow's own preparation tasks, locally: their Flyte cache lives under HOME, which main sets first."""
    from tasks.prepare import admit_model, base_model, make_data
    from tasks.rl import convert
    from tasks.sft import sft

    base = admit_model(base=base_model(cfg=cfg.model, root=cfg.run_root), train=cfg.train, rollout=cfg.rollout)
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
    ready, consumed, steps_metrics, stages = time.perf_counter(), [], [], []
    for step in range(steps):
        samples, _, metrics = run_step(engine, source, tokenizer, fns, trainer, [], step)
        steps_metrics.append(metrics)
        engine.load_state_dict(trainer.model.state_dict(), start.version + step + 1)
        consumed.append(samples)
        stages.append({k: metrics[f"time/{k}_s"] for k in ("rollout", "score", "train")})
    out = summary(consumed, steps_metrics, ready - started, time.perf_counter() - ready)
    out["stage_s_per_step"] = {k: round(statistics.fmean(s[k] for s in stages), 3) for k in stages[0]}
    return out, engine


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
    out_summary = summary(result.consumed, result.steps, m["time/async_startup_s"], m["time/async_train_s"])
    out_summary.update({k.split("/")[1]: round(v, 3) for k, v in m.items() if k.startswith("async/") and "_per_s" not in k})
    out_summary["phase_wall_s"] = round(m["time/async_phase_s"], 1)  # start-up + run + finishing (buffer drained, checkpoint saved)
    per_step = spec.rollout.prompts_per_step * spec.rollout.n_samples / (m["async/generated_samples_per_s"] * m["time/async_train_s"])
    out_summary["stage_s_per_step"] = {
        "train": round(statistics.fmean(s["time/train_s"] for s in result.steps), 3),
        "trainer_idle": round(statistics.fmean(s["async/trainer_idle_s"] for s in result.steps), 3),
        "weight_push": round(statistics.fmean(s["async/weight_push_s"] for s in result.steps), 3),
        # rollout actors' seconds per step's worth of samples, summed over the actors
        "rollout_generate": round((m["async/rollout_busy_s"] - m["async/rollout_score_s"]) * per_step, 3),
        "rollout_score": round(m["async/rollout_score_s"] * per_step, 3),
    }
    return out_summary, make_engine(cfg.rollout, out, start.version + steps, num_threads=2)


def summary(consumed, steps: list[dict], startup_s: float, run_s: float) -> dict:
    """Throughput over the training run (first rollout to last step), start-up apart; the reward and how far off-policy
    the trained samples were (the trainer's policy at each step's start against the policy that generated them)."""
    samples = sum(len(b) for b in consumed)
    tokens = sum(len(s.response_tokens) for b in consumed for s in b)
    rewards = [m["reward/mean"] for m in steps]
    quarter = max(len(rewards) // 4, 1)
    return {
        "samples_per_s": round(samples / run_s, 2),
        "tokens_per_s": round(tokens / run_s, 1),
        "run_s": round(run_s, 2),
        "startup_s": round(startup_s, 1),
        "samples": samples,
        "final_reward": round(statistics.fmean(rewards[-3:]), 3),
        "reward_by_quarter": [round(statistics.fmean(rewards[i : i + quarter]), 3) for i in range(0, len(rewards), quarter)],
        "reward_failures": sum("reward_error" in s.metadata for b in consumed for s in b),
        "behaviour_kl": round(statistics.fmean(m["mismatch/kl_rollout_train"] for m in steps), 4),
    }


def bound_by(sync: dict, async_: dict, workers: int, reward_slots: int | None) -> dict[str, str]:
    """What limits each side's throughput, from the stage times measured in the run; reward_slots: the remote reward
    model's requests in flight per process (reward.remote_concurrency), None when rewards are scored locally."""
    stages = sync["stage_s_per_step"]
    named = {"rollout": "generation", "score": "reward wait", "train": "training"}
    largest = max(stages, key=stages.get)
    sync_says = (
        f"{named[largest]}: {stages[largest]:.3f} s of a {sum(stages.values()):.3f} s step ("
        + ", ".join(f"{named[k]} {v:.3f} s" for k, v in stages.items())
        + ", one after another"
        + (f"; at most {reward_slots} reward requests in flight)" if reward_slots else ")")
    )
    a = async_["stage_s_per_step"]
    trainer_busy = a["train"] + a["weight_push"]
    if a["trainer_idle"] < 0.25 * trainer_busy:  # the trainer hardly waits: it sets the pace
        async_says = f"training: the trainer waited {a['trainer_idle']:.3f} s per step for samples and worked {trainer_busy:.3f} s"
    else:
        supply = "reward wait" if a["rollout_score"] >= a["rollout_generate"] else "generation"
        async_says = (
            f"rollout supply, mostly {supply}: the trainer waited {a['trainer_idle']:.3f} s per step for samples (worked {trainer_busy:.3f} s); "
            f"a step's samples took the {workers} rollout actors {a['rollout_score']:.3f} s of reward wait and {a['rollout_generate']:.3f} s "
            "of generation, actor-seconds summed"
            + (f" (at most {reward_slots} reward requests in flight per actor, {reward_slots * workers} in all)" if reward_slots else "")
        )
    if async_["dropped_samples"]:
        async_says += f"; {async_['dropped_samples']:.0f} samples generated and scored were dropped as staler than async_phase.max_staleness"
    return {"sync": sync_says, "async": async_says}


def held_out(cfg, engine, prompts, tokenizer) -> dict:
    """Greedy accuracy on the held-out prompts, with its standard error over them (a binomial's)."""
    accuracy = evaluate_policy(engine, prompts, tokenizer, bind(rollout=cfg.rollout, reward=cfg.reward, evaluation=cfg.evaluation))["eval/accuracy"]
    return {"held_out_accuracy": round(accuracy, 3), "held_out_accuracy_se": round(math.sqrt(accuracy * (1 - accuracy) / len(prompts)), 3)}


def remote_scored(cfg, url: str):
    """cfg with every reward fetched from the reward model at url (the project's remote reward path: rewards.hub:remote)."""
    return dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, fn="miles_core.rewards.hub:remote", remote_url=url))


def compare(cfg, args) -> dict:
    load_before = os.getloadavg()[0]
    root = Path(cfg.run_root)
    start, dataset, ckpt = prepare(cfg)
    prompts = load_prompts(dataset.train.path, cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key)
    tokenizer = AutoTokenizer.from_pretrained(start.dir.path)
    cfg = dataclasses.replace(cfg, async_phase=dataclasses.replace(cfg.async_phase, threads_per_actor=args.threads))
    sync, sync_engine = run_sync(cfg, start, prompts, ckpt.dir.path, args.steps, args.threads)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    async_, async_engine = run_async(cfg, start, prompts, ckpt.dir.path, args.steps, str(root / "async-ckpt"))
    ray.shutdown()
    if sync["samples"] != async_["samples"]:
        raise RuntimeError(f"the sides trained on different numbers of samples: sync {sync['samples']}, async {async_['samples']}")
    test = load_prompts(dataset.test.path, cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key)
    sync.update(held_out(cfg, sync_engine, test, tokenizer))
    async_.update(held_out(cfg, async_engine, test, tokenizer))
    start_engine = make_engine(cfg.rollout, start.dir.path, start.version, num_threads=args.threads)
    slots = cfg.reward.remote_concurrency if args.remote_reward_delay else None
    return {
        "bench": "async_vs_sync",
        "recipe": args.recipe,
        "steps": args.steps,
        "overrides": args.overrides,
        "threads_per_process": args.threads,
        "rollout_workers": cfg.async_phase.rollout_workers,
        "cores": os.cpu_count(),
        "remote_reward_delay_s": args.remote_reward_delay,
        "remote_concurrency": slots,
        "trained_samples": sync["samples"],
        "held_out_prompts": len(test),
        "start_held_out_accuracy": held_out(cfg, start_engine, test, tokenizer)["held_out_accuracy"],
        "sync": sync,
        "async": async_,
        "ratio_samples_per_s": round(async_["samples_per_s"] / sync["samples_per_s"], 2),
        "ratio_tokens_per_s": round(async_["tokens_per_s"] / sync["tokens_per_s"], 2),
        "bound_by": bound_by(sync, async_, cfg.async_phase.rollout_workers, slots),
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/smoke_async.yaml")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--work-dir",
        default="",
        help="HOME and run root of the preparation tasks (base model, data, SFT): reuse one to take them from its Flyte cache (default: a new temporary folder)",
    )
    parser.add_argument(
        "--remote-reward-delay",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        help="score both sides through a reward model on loopback (reward.fn: miles_core.rewards.hub:remote) that answers with "
        "the recipe's own reward.fn after LOW-HIGH seconds (bench/reward_server.py)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    args = parser.parse_args()
    os.environ["HOME"] = args.work_dir or tempfile.mkdtemp(prefix="bench-async-")  # the preparation tasks' Flyte cache
    overrides = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    cfg = dataclasses.replace(load_recipe(REPO / args.recipe, overrides), run_root=str(Path(os.environ["HOME"]) / "runs"))
    with contextlib.ExitStack() as stack:
        if args.remote_reward_delay:
            cfg = remote_scored(cfg, stack.enter_context(serving(*args.remote_reward_delay, seed=0, reward_fn=cfg.reward.fn)))
        result = compare(cfg, args)
    emit(result)


if __name__ == "__main__":
    main()
