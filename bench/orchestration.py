"""Orchestration overhead of one RL iteration in the looped Flyte DAG. Prints one JSON object.

Runs the workflow locally (`pyflyte run`, fresh cache and run root) on a recipe, then reads the
MLflow run: iteration wall time is the gap between consecutive `log_iteration` calls; the tasks'
own compute is what rollout, score and train measured inside themselves. The difference is what
Flyte (serialisation, cache look-ups, task start) plus per-task model loading, parquet I/O,
publishing and tracking cost.

    python bench/orchestration.py [--recipe recipes/smoke.yaml] [--iterations 6]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from measure import emit
from runner import metric, mlflow_runs, run_workflow


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/smoke.yaml")
    parser.add_argument("--iterations", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        started = time.perf_counter()
        run_workflow(args.recipe, root, tmp, f"iterations={args.iterations}", "evaluation.interval=1000")
        total = time.perf_counter() - started
        client, (run,) = mlflow_runs(root)
        series = {k: metric(client, run, k) for k in ("time_logged_at", "time_rollout_s", "time_score_s", "time_train_s")}
    steps = sorted(series["time_logged_at"])
    walls = [series["time_logged_at"][b] - series["time_logged_at"][a] for a, b in zip(steps, steps[1:])]
    compute = [sum(series[k][b] for k in ("time_rollout_s", "time_score_s", "time_train_s")) for b in steps[1:]]
    overheads = [w - c for w, c in zip(walls, compute)]
    emit(
        {
            "bench": "orchestration",
            "recipe": args.recipe,
            "iterations": args.iterations,
            "iteration_wall_s_median": round(statistics.median(walls), 3),
            "task_compute_s_median": round(statistics.median(compute), 3),
            "overhead_s_median": round(statistics.median(overheads), 3),
            "overhead_fraction": round(statistics.median(overheads) / statistics.median(walls), 3),
            "workflow_total_s": round(total, 1),
        }
    )


if __name__ == "__main__":
    main()
