"""Orchestration overhead of one RL iteration in the looped Flyte DAG, stage by stage. Prints one JSON object.

Runs the workflow locally (`pyflyte run`, fresh cache and run root) on a recipe, then reads the MLflow run: iteration
wall time is the gap between consecutive `log_iteration` calls; the tasks' own compute is what rollout, score and train
measured inside themselves. The difference is what Flyte (serialisation, cache look-ups, task start, the Elastic
tasks' rendezvous and worker polling, decks) plus per-task model loading, batch I/O, checkpoints, publishing and
tracking cost.

Each stage's wall time is the gap between the ends of consecutive tasks. A task ends when flytekit uploads its
outputs, which a local run copies under the run root: the newest file of an iteration's artifact (rollout batch,
scored batch, checkpoint, policy) is written as its task returns. The log stage ends where `log_iteration` takes its
timestamp, so the rest of that task counts to the next iteration's rollout stage. The rollout, score and train stages'
overhead splits in two by each task's own record of its whole body (`time/<stage>_task_s`): `in_task_s`, the body
beside the compute (downloads, model and tokenizer loads, batch reads, writes and checks, checkpoint saves, decks),
and `outside_task_s`, the rest of the stage (Flyte: input and output literals, cache look-ups and writes, uploads,
task start; an Elastic task's worker start). Peak RSS is the largest process the
run started (the workflow's, or a forked Elastic worker's).

    python bench/orchestration.py [--recipe recipes/tiny_arith_cpu.yaml] [--iterations 6] [key=value ...]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import emit
from runner import REPO, metric, mlflow_runs, run_workflow

COMPUTE = {"rollout": "time_rollout_s", "score": "time_score_s", "train": "time_train_s"}
BODY = {stage: f"time_{stage}_task_s" for stage in COMPUTE}  # each task's whole body, its own I/O included


def task_ends(root: Path, stage: str) -> list[float]:
    """When each artifact of `stage` under the run root was uploaded (the newest file it holds), in iteration order."""
    artifacts = sorted(p for p in (root / stage).iterdir() if not p.name.endswith(".buffer.parquet"))
    return [max(f.stat().st_mtime for f in ([a] if a.is_file() else a.rglob("*")) if f.is_file()) for a in artifacts]


STAGES = ("rollout", "score", "train", "publish", "log")


def stage_walls(root: Path, logged: list[float]) -> dict[str, list[float]]:
    """{stage: its wall time in each iteration after the first}, from the end of the task before it to its own end."""
    checkpoints = task_ends(root, "checkpoint")[1:]  # the first is the converted start
    ends = list(zip(task_ends(root, "rollout"), task_ends(root, "scored"), checkpoints, task_ends(root, "policy"), logged))
    walls = [[b - a for a, b in zip((logged[i - 1], *ends[i]), ends[i])] for i in range(1, len(logged))]
    return {stage: [w[j] for w in walls] for j, stage in enumerate(STAGES)}


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


POD_MODULES = ("tasks.tracking", "tasks.rl")


def pod_import_s(module: str, repeats: int = 3) -> float:
    """Median wall time of a fresh interpreter that imports `module`, as a task's pod does before its task runs."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {module}"], cwd=REPO, check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/tiny_arith_cpu.yaml")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides (sft.steps=50 for a quick look)")
    args = parser.parse_args()
    pod_import = {module: pod_import_s(module) for module in POD_MODULES}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        started = time.perf_counter()
        run_workflow(args.recipe, root, tmp, f"iterations={args.iterations}", "evaluation.interval=1000", *args.overrides)
        total = time.perf_counter() - started
        client, (run,) = mlflow_runs(root)
        series = {k: metric(client, run, k) for k in ("time_logged_at", *COMPUTE.values(), *BODY.values())}
        steps = sorted(series["time_logged_at"])
        walls = stage_walls(root, [series["time_logged_at"][s] for s in steps])
    iteration = [sum(stage) for stage in zip(*walls.values())]
    compute = [sum(series[k][s] for k in COMPUTE.values()) for s in steps[1:]]
    overheads = [w - c for w, c in zip(iteration, compute)]
    stages = {stage: {"wall_s": median(wall), "overhead_s": median(wall)} for stage, wall in walls.items()}
    for stage in COMPUTE:
        wall, compute_s, body_s = walls[stage], series[COMPUTE[stage]], series[BODY[stage]]
        stages[stage] |= {
            "overhead_s": median([w - compute_s[s] for w, s in zip(wall, steps[1:])]),
            "in_task_s": median([body_s[s] - compute_s[s] for s in steps[1:]]),  # the task's reads, writes, checks, loads, decks
            "outside_task_s": median([w - body_s[s] for w, s in zip(wall, steps[1:])]),  # Flyte's: serialisation, cache, task start
        }
    emit(
        {
            "bench": "orchestration",
            "recipe": args.recipe,
            "overrides": args.overrides,
            "iterations": args.iterations,
            "iteration_wall_s_median": median(iteration),
            "task_compute_s_median": median(compute),
            "overhead_s_median": median(overheads),
            "overhead_fraction": round(statistics.median(overheads) / statistics.median(iteration), 3),
            "stages": stages,
            "pod_import_s": pod_import,
            "workflow_total_s": round(total, 1),
        }
    )


if __name__ == "__main__":
    main()
