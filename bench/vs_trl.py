"""Time to held-out accuracy against TRL's GRPOTrainer, from the same SFT start. Prints one JSON object.

Both sides start from the policy the workflow's SFT task publishes and train on the same prompts (the run's train
split), with the same reward (the recipe's reward function, imported), chat template, group size, prompts per step,
optimizer steps per batch (`trl_settings` maps the recipe onto GRPOConfig and refuses what TRL cannot express),
generation length, temperature, clip range and no KL. Both are judged by the same greedy evaluation
(`miles_core.step.evaluate` in the embedded engine on the run's held-out split) every `--eval-interval` batches.

Ours runs as a user runs it: `pyflyte run workflows/rl.py rl` (bench/runner.py), once for `iterations=1` with other
rollout and train seeds so that the model, data and SFT are in the Flyte cache and nothing after them is, then the
measured run. TRL runs in its own environment (`trl_env`: created once, the project's packages plus
bench/trl_requirements.txt) in a subprocess (bench/trl_grpo.py), once per learning rate of `--lrs`; the best is the
one that reaches the most targets, then the hardest of them soonest.

Two clocks, evaluation excluded from both:
* rl_s, the RL steps. Ours: the sum of the rollout, score and train tasks' own measured time (`time/rollout_s`,
  `time/score_s`, `time/train_s`: generation, rewards, old log-probs and the optimizer steps; not model loading,
  parquet and checkpoint I/O or publishing). TRL: the trainer's wall time since `on_train_begin` (generation, rewards,
  log-probs, optimizer steps and its own bookkeeping).
* total_s, everything. Ours: from launching `pyflyte run` (SFT already cached) to each evaluated iteration's
  `log_iteration` task, less every evaluate task's own time (`time/evaluate_s`): Flyte start-up, cache look-ups,
  the MLflow run, conversion, every task's start, model loading, artifacts and publishing count. TRL: from launching
  its interpreter (its environment already set up) to each evaluation, less the evaluations: imports, model and data
  loading and the trainer's construction count. Ours' start evaluation has no log time: it counts as 0 there.

Targets: the SFT start's accuracy plus each of `--targets` (points). For each, each side's rl_s and total_s at its
first evaluation at or above it (null if none within the budget) and the ratios ours / TRL; and each side's accuracy
at the same time on each clock, the time the side that stopped first stopped.

    python bench/vs_trl.py [--recipe recipes/tiny_arith_cpu.yaml] [--iterations 8] [--trl-steps 24] [--lrs ...] [--root DIR]
    python bench/vs_trl.py --smoke    # the smoke recipe, a few steps, one learning rate: a few minutes

On a machine without the workflow's stack (a GPU machine with torch and transformers alone), ours runs in the
benchmark's process from an SFT start prepared where the workflow runs:
    python bench/vs_trl.py --prepare DIR                                # here: the SFT start and the data, into DIR
    python bench/vs_trl.py --prepared DIR --device cuda --trl-python python3   # there: both sides on the GPU
In that mode ours is the sync loop's step (`miles_core.step.run_step`, then the new weights into the engine in memory)
with no Flyte: rl_s is each step's wall time, total_s runs from the start of loading (engine, trainer, data) to each
evaluation, less the evaluations. `--trl-python` names an interpreter that already has TRL (no package registry there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from measure import emit, synchronize
from transformers import AutoTokenizer

from miles_core.config import RunConfig, load_recipe
from miles_core.data.source import DataState, load_prompts
from miles_core.plugins import plugin
from miles_core.rollout.engines import make_engine
from miles_core.step import bind, run_step
from miles_core.train.torch_backend import TorchTrainer

REPO = Path(__file__).resolve().parents[1]

TRL_REQUIREMENTS = Path(__file__).with_name("trl_requirements.txt")
TRL_VERSION = next(line.split("==")[1].split()[0] for line in TRL_REQUIREMENTS.read_text().splitlines() if line.startswith("trl=="))
LOSS_TYPES = {"token-mean": "bnpo", "seq-mean-token-mean": "grpo"}  # our aggregation -> TRL's loss_type that computes it
CLOCKS = ("rl_s", "total_s")


def trl_env(cache: Path | None = None) -> tuple[Path, float]:
    """The python of TRL's environment and the seconds spent setting it up (0 when it was ready). A venv under
    ~/.cache/miles-flyte/trl-<version> without pip or setuptools of its own that sees this interpreter's packages (a .pth
    file adds its site-packages after the venv's own) and holds bench/trl_requirements.txt, installed by this pip, by
    hash, without dependencies; rebuilt when that file changes."""
    env = (cache or Path.home() / ".cache" / "miles-flyte") / f"trl-{TRL_VERSION}"
    python, stamp = env / "bin" / "python", env / ".installed"
    wanted = hashlib.sha256(TRL_REQUIREMENTS.read_bytes()).hexdigest()
    if stamp.is_file() and stamp.read_text() == wanted and python.exists():
        return python, 0.0
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(env)], stdout=sys.stderr, check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True)
    ours = sysconfig.get_paths()["purelib"]
    (Path(site.stdout.strip()) / "miles_flyte_project.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check"]  # this pip, run in the new environment
    subprocess.run(
        [*pip, "install", "--quiet", "--no-deps", "--ignore-installed", "--require-hashes", "-r", str(TRL_REQUIREMENTS)], stdout=sys.stderr, check=True
    )
    subprocess.run([*pip, "check"], stdout=sys.stderr, check=True)
    stamp.write_text(wanted)
    return python, time.monotonic() - started


def trl_settings(cfg: RunConfig) -> dict:
    """GRPOConfig's arguments that make one TRL generation batch one of our RL steps: prompts_per_step x n_samples
    completions, split into train.mini_batches optimizer steps of one forward each (no gradient accumulation), old
    log-probs recomputed before the first, the same sampling, clip range, advantage scaling, loss aggregation, warm-up
    and AdamW settings. Refuses, naming every key, a recipe whose step TRL does not compute."""
    rollout, algo, train, reward = cfg.rollout, cfg.algo, cfg.train, cfg.reward
    completions = rollout.prompts_per_step * rollout.n_samples
    refusals = {
        "async_phase.schedule": cfg.async_phase.schedule != "sync",  # ours' clocks read the sync iterations' metrics
        "rollout.dynamic_sampling": rollout.dynamic_sampling,
        "rollout.generate_fn": rollout.generate_fn != "miles_core.step:generate",
        "reward.group_fn": reward.group_fn != "miles_core.rewards.base:each_sample",
        "reward.post_fn": reward.post_fn != "miles_core.rewards.base:no_post_processing",
        "algo.advantage": algo.advantage != "grpo",
        "algo.policy_loss": algo.policy_loss != "ppo",
        "algo.loss_aggregation": algo.loss_aggregation not in LOSS_TYPES,
        "algo.kl_coef": algo.kl_coef != 0,
        "algo.entropy_coef": algo.entropy_coef != 0,
        "algo.dual_clip": algo.dual_clip != 0,
        "algo.use_rollout_logprobs": algo.use_rollout_logprobs,
        "algo.is_correction": algo.is_correction != "none",
        "train.mini_batches": completions % train.mini_batches != 0,
        "train.dtype": train.dtype != "float32",
        "train.lora.rank": train.lora.rank != 0,
        "train.qat": bool(train.qat),
    }
    refused = [key for key, bad in refusals.items() if bad]
    if refused:
        raise ValueError(f"TRL's GRPOTrainer does not compute this recipe's step: {', '.join(refused)} (see bench/vs_trl.py trl_settings)")
    return {
        "num_generations": rollout.n_samples,
        "per_device_train_batch_size": completions // train.mini_batches,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": train.mini_batches,
        "num_iterations": 1,
        "max_completion_length": rollout.max_new_tokens,
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "top_k": rollout.top_k,
        "beta": 0.0,
        "epsilon": algo.eps_clip_low,
        "epsilon_high": algo.eps_clip_high,
        "scale_rewards": "group" if algo.normalize_std else "none",
        "loss_type": LOSS_TYPES[algo.loss_aggregation],
        "lr_scheduler_type": "constant_with_warmup",
        "warmup_steps": train.warmup_steps,
        "adam_beta1": train.beta1,
        "adam_beta2": train.beta2,
        "weight_decay": train.weight_decay,
        "max_grad_norm": train.grad_clip,
        "seed": train.seed,
        "bf16": False,
        "gradient_checkpointing": False,
    }


def first_reaching(points: list[dict], target: float) -> dict | None:
    """The first evaluation point (in time order) whose accuracy is at least `target`, or None."""
    return next((p for p in points if p["accuracy"] >= target - 1e-9), None)


def accuracy_at(points: list[dict], seconds: float, clock: str) -> float:
    """The accuracy of the last evaluation point at or before `seconds` on `clock` (the start's, before any)."""
    before = [p for p in points if p[clock] <= seconds + 1e-9]
    return (before or points[:1])[-1]["accuracy"]


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 3) if ours is not None and theirs else None


def comparison(ours: list[dict], trl: list[dict], targets: list[float]) -> dict:
    """Time to each target on both clocks and the ratios ours / TRL; each side's accuracy at the same time on each clock
    (when the side that stopped first stopped)."""
    rows = []
    for target in targets:
        row = {"target": round(target, 4)}
        for clock in CLOCKS:
            reached = {side: first_reaching(points, target) for side, points in (("ours", ours), ("trl", trl))}
            for side, point in reached.items():
                row[f"{side}_{clock}"] = round(point[clock], 1) if point else None
            row[f"ratio_{clock}"] = ratio(row[f"ours_{clock}"], row[f"trl_{clock}"])
        rows.append(row)
    same = {}
    for clock in CLOCKS:
        seconds = min(ours[-1][clock], trl[-1][clock])
        same[clock] = {"seconds": round(seconds, 1), "ours": accuracy_at(ours, seconds, clock), "trl": accuracy_at(trl, seconds, clock)}
    return {"time_to_target": rows, "accuracy_at_same_time": same}


def best_run(runs: dict[float, list[dict]], targets: list[float]) -> float:
    """The learning rate whose run reaches the most targets, then the hardest it reaches soonest (RL-step clock), then
    ends highest."""

    def rank(lr: float) -> tuple:
        reached = [p for p in (first_reaching(runs[lr], t) for t in targets) if p is not None]
        return (-len(reached), reached[-1]["rl_s"] if reached else 0.0, -runs[lr][-1]["accuracy"])

    return min(runs, key=rank)


def sft_start(recipe: str, tmp: Path) -> dict:
    """A one-iteration run with other rollout and train seeds, which leaves the SFT start in the Flyte cache -> that
    start's directory and the run's train and test files."""
    from runner import mlflow_runs, run_workflow  # the workflow's stack (Flyte, MLflow): not on a machine that runs --prepared

    cfg = load_recipe(recipe)
    root = tmp / "runs"
    seeds = {"rollout.seed": str(cfg.rollout.seed), "train.seed": str(cfg.train.seed)}
    if (root / "mlflow.db").is_file() and any(seeds.items() <= r.data.params.items() for r in mlflow_runs(root)[1]):
        raise SystemExit(f"{root}: a run with the measured rollout and train seeds ran there, its iterations would be cache hits: use another --root")
    print("ours: preparing the SFT start (a one-iteration run with other rollout and train seeds)", file=sys.stderr, flush=True)
    run_workflow(recipe, root, str(tmp), "iterations=1", f"rollout.seed={cfg.rollout.seed + 1}", f"train.seed={cfg.train.seed + 1}")
    run = max(mlflow_runs(root)[1], key=lambda r: r.info.start_time)
    start_dir = run.data.tags["parent_policy_dir"]
    data_dir = Path(start_dir).parents[1] / "data"
    return {"start_dir": start_dir, **{f"{split}_file": str(next(data_dir.glob(f"*/{split}.jsonl"))) for split in ("train", "test")}}


def our_run(recipe: str, tmp: Path, iterations: int, interval: int) -> tuple[list[dict], dict]:
    """The workflow's evaluation points (after `sft_start`, so the start is a cache hit) and the SFT start's files."""
    from runner import metric, mlflow_runs, run_workflow

    files = sft_start(recipe, tmp)
    print(f"ours: the measured run, {iterations} iterations", file=sys.stderr, flush=True)
    launched = time.time()
    run_workflow(recipe, tmp / "runs", str(tmp), f"iterations={iterations}", f"evaluation.interval={interval}")
    client, runs = mlflow_runs(tmp / "runs")
    run = max(runs, key=lambda r: r.info.start_time)
    series = {k: metric(client, run, k) for k in ("eval_accuracy", "time_evaluate_s", "time_logged_at", "time_rollout_s", "time_score_s", "time_train_s")}
    points, rl_s, evaluating = [], 0.0, 0.0
    for step in range(iterations + 1):
        rl_s += sum(series[k].get(step, 0.0) for k in ("time_rollout_s", "time_score_s", "time_train_s"))
        if step in series["eval_accuracy"]:
            total_s = series["time_logged_at"][step] - launched - evaluating - series["time_evaluate_s"][step] if step else 0.0
            evaluating += series["time_evaluate_s"][step]
            points.append({"iteration": step, "rl_s": rl_s, "total_s": total_s, "accuracy": series["eval_accuracy"][step]})
    return points, files


def prepared_files(directory: Path) -> dict:
    """The SFT start and data that `--prepare` copied into `directory`."""
    return {"start_dir": str(directory / "start"), "train_file": str(directory / "train.jsonl"), "test_file": str(directory / "test.jsonl")}


def prepare(recipe: str, tmp: Path, out: Path) -> None:
    """`sft_start`'s directory and files copied into `out`, for `--prepared` on another machine."""
    files = sft_start(recipe, tmp)
    shutil.copytree(files["start_dir"], out / "start", dirs_exist_ok=True)
    for split in ("train", "test"):
        shutil.copyfile(files[f"{split}_file"], out / f"{split}.jsonl")
    print(f"prepared {recipe} in {out}: {', '.join(sorted(p.name for p in out.iterdir()))}", file=sys.stderr)


def in_process_run(cfg: RunConfig, files: dict, iterations: int, interval: int, device: str) -> list[dict]:
    """Ours without Flyte (module docstring): evaluation points of the sync loop's steps in this process, the engine and
    the trainer on `device`."""
    launched = time.perf_counter()
    start = files["start_dir"]
    engine = make_engine(cfg.rollout, start, 0, device=device)
    trainer = TorchTrainer.from_hf(start, cfg.train, device=device)
    tokenizer = AutoTokenizer.from_pretrained(start)
    train, held_out = (load_prompts(files[f"{split}_file"], cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key) for split in ("train", "test"))
    source = plugin(cfg.data, "data", "source_fn")(train, cfg.data.seed, DataState())
    fns = bind(rollout=cfg.rollout, reward=cfg.reward, algo=cfg.algo, hooks=cfg.hooks, evaluation=cfg.evaluation)
    points, buffer, rl_s, evaluating = [], [], 0.0, 0.0
    for step in range(iterations + 1):
        if step % interval == 0 or step == iterations:
            paused = time.perf_counter()
            accuracy = fns.evaluate_fn(engine, held_out, tokenizer, fns)["eval/accuracy"]
            points.append({"iteration": step, "rl_s": rl_s, "total_s": paused - launched - evaluating, "accuracy": accuracy})
            evaluating += time.perf_counter() - paused
            print(f"ours step {step}: held-out accuracy {accuracy:.3f}", file=sys.stderr, flush=True)
        if step < iterations:
            began = time.perf_counter()
            _, buffer, _ = run_step(engine, source, tokenizer, fns, trainer, buffer, step)
            engine.load_state_dict(trainer.hf_state_dict(), step + 1)
            synchronize(device)
            rl_s += time.perf_counter() - began
    return points


def trl_run(python: Path, job: dict, tmp: Path) -> list[dict]:
    """One TRL run (bench/trl_grpo.py in TRL's environment): its evaluation points, total_s counted from the launch."""
    out = tmp / f"trl-{job['learning_rate']}.jsonl"
    spec = tmp / "trl-job.json"
    spec.write_text(json.dumps({**job, "points_file": str(out)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    launched = time.time()
    subprocess.run([str(python), str(Path(__file__).with_name("trl_grpo.py")), str(spec)], cwd=REPO, env=env, stdout=sys.stderr, check=True)
    points = [json.loads(line) for line in out.read_text().splitlines()]
    return [{"iteration": p["completions"] / job["completions_per_batch"], **p, "total_s": p["wall"] - launched - p["paused_s"]} for p in points]


def curve(points: list[dict]) -> list[list[float]]:
    """[iteration, rl_s, total_s, accuracy] per evaluation, rounded for the report."""
    return [[round(p["iteration"], 2), round(p["rl_s"], 1), round(p["total_s"], 1), round(p["accuracy"], 4)] for p in points]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/tiny_arith_cpu.yaml")
    parser.add_argument("--iterations", type=int, default=8, help="our RL iterations (each one generation batch)")
    parser.add_argument("--trl-steps", type=int, default=24, help="TRL optimizer steps per learning rate (train.mini_batches per generation batch)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3], help="TRL's learning rates tried")
    parser.add_argument("--eval-interval", type=int, default=1, help="generation batches between evaluations, both sides")
    parser.add_argument("--targets", type=float, nargs="+", default=[10, 20, 30], help="accuracy targets: points above the SFT start")
    parser.add_argument(
        "--root",
        default="",
        help="run root and Flyte home kept between runs: its cached SFT start is reused, a root where the measured run already ran is refused (default: a fresh one)",
    )
    parser.add_argument("--smoke", action="store_true", help="recipes/smoke.yaml, 2 iterations, 4 TRL steps, one learning rate")
    parser.add_argument("--prepare", default="", help="only write the SFT start and the data into this directory (for --prepared elsewhere)")
    parser.add_argument("--prepared", default="", help="a --prepare directory: ours runs in this process from it, without Flyte")
    parser.add_argument("--device", default="cpu", help="torch device of both sides (not cpu: needs --prepared)")
    parser.add_argument("--trl-python", default="", help="an interpreter that has TRL (default: TRL's environment, set up here)")
    args = parser.parse_args()
    if args.device != "cpu" and not args.prepared:
        parser.error("--device other than cpu runs ours in this process: give --prepared DIR (written by --prepare DIR where the workflow runs)")
    if args.smoke:
        args.recipe, args.iterations, args.trl_steps, args.lrs = "recipes/smoke.yaml", 2, 4, [5e-4]
    return args


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.root).resolve() if args.root else Path(scratch)
        if args.prepare:
            return prepare(args.recipe, tmp, Path(args.prepare).resolve())
        python, setup_s = (Path(args.trl_python), 0.0) if args.trl_python else trl_env()
        cfg = load_recipe(args.recipe)
        settings = trl_settings(cfg)
        if args.prepared:
            files = prepared_files(Path(args.prepared).resolve())
            ours = in_process_run(cfg, files, args.iterations, args.eval_interval, args.device)
        else:
            ours, files = our_run(args.recipe, tmp, args.iterations, args.eval_interval)
        job = {
            **files,
            "recipe": str(REPO / args.recipe),
            "settings": settings,
            "max_steps": args.trl_steps,
            "eval_steps": settings["steps_per_generation"] * args.eval_interval,
            "completions_per_batch": cfg.rollout.prompts_per_step * cfg.rollout.n_samples,
            "device": args.device,
        }
        trl = {}
        for lr in args.lrs:
            print(f"TRL: learning rate {lr}, {args.trl_steps} optimizer steps", file=sys.stderr, flush=True)
            trl[lr] = trl_run(python, {**job, "learning_rate": lr}, Path(scratch))
    start = ours[0]["accuracy"]
    targets = [start + t / 100 for t in args.targets]
    best = best_run(trl, targets)
    emit(
        {
            "bench": "vs_trl",
            "recipe": args.recipe,
            "trl_version": TRL_VERSION,
            "step": {
                "prompts": cfg.rollout.prompts_per_step,
                "group_size": cfg.rollout.n_samples,
                "optimizer_steps": cfg.train.mini_batches,
                "max_new_tokens": cfg.rollout.max_new_tokens,
                "temperature": cfg.rollout.temperature,
                "clip": [cfg.algo.eps_clip_low, cfg.algo.eps_clip_high],
                "kl_coef": cfg.algo.kl_coef,
                "heldout_prompts": cfg.data.test_size,
            },
            "trl_settings": settings,
            "ours_lr": cfg.train.lr,
            "trl_lrs_tried": args.lrs,
            "trl_best_lr": best,
            "accuracy_start": {"ours": start, "trl": trl[best][0]["accuracy"]},
            "targets_points": args.targets,
            **comparison(ours, trl[best], targets),
            "ours_curve": curve(ours),
            "trl_curves": {str(lr): curve(points) for lr, points in trl.items()},
            "curve_columns": ["iteration", "rl_s", "total_s", "accuracy"],
            "trl_env_setup_s": round(setup_s, 1),
            "bench_wall_s": round(time.monotonic() - started, 1),
            "cpus": os.cpu_count(),
            "ours_mode": "in process, no Flyte (--prepared)" if args.prepared else "pyflyte run",
            "device": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu",
        }
    )


if __name__ == "__main__":
    main()
