"""Each algorithm family on the main task, from one SFT start, after the same number of samples.
Prints one JSON object; the runs are one MLflow experiment ("families") to compare side by side.

Every family's recipe (recipes/<family>.yaml, GRPO = the main recipe) runs through the workflow
with the same iterations, prompts per step and group size, so every family trains on the same
number of samples; dynamic sampling (DAPO) generates more, reported as `generated_samples`. The
runs share one Flyte cache and run root, so the base model, data, SFT and its evaluation are
computed once and every family starts from the same policy. That cache lives in the run root
(`<root>/.flyte-home`), so deleting the root forgets both together.

    python bench/families.py [--root runs] [--iterations 30]     # then `make ui`
"""

import argparse
import sys
from pathlib import Path

from measure import emit
from runner import REPO, metric, mlflow_runs, run_workflow

from miles_core.config import load_recipe

FAMILIES = {"grpo": "tiny_arith_cpu", "dapo": "dapo", "dr_grpo": "dr_grpo", "gspo": "gspo", "reinforce_pp": "reinforce_pp", "rloo": "rloo", "ppo": "ppo"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=str(REPO / "runs"), help="run root (its mlflow.db is what `make ui` shows)")
    parser.add_argument("--iterations", type=int, default=0, help="RL iterations per family (0 = the recipe's)")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    args = parser.parse_args()
    root = Path(args.root).resolve()
    results = {}
    for family in args.families:
        recipe = f"recipes/{FAMILIES[family]}.yaml"
        cfg = load_recipe(recipe)
        iterations = args.iterations or cfg.iterations
        run_workflow(
            recipe,
            root,
            str(root / ".flyte-home"),
            f"name={family}",
            f"iterations={iterations}",
            "tracking.experiment=families",
            f"evaluation.interval={max(iterations // 6, 1)}",
        )
        client, runs = mlflow_runs(root)
        run = max((r for r in runs if r.info.run_name.rsplit("-", 1)[0] == family), key=lambda r: r.info.start_time)
        accuracy = metric(client, run, "eval_accuracy")
        results[family] = {
            "accuracy_sft_start": accuracy[0],
            "accuracy_after_rl": accuracy[max(accuracy)],
            "accuracy_curve": [round(accuracy[k], 3) for k in sorted(accuracy)],
            "trained_samples": iterations * cfg.rollout.prompts_per_step * cfg.rollout.n_samples,
            "generated_samples": int(sum(metric(client, run, "rollout_generated_samples").values())),
            "rl_phase_s": round((run.info.end_time - run.info.start_time) / 1000, 1),
            "mlflow_run_id": run.info.run_id,
        }
        print(f"{family}: held-out accuracy {accuracy[0]:.3f} -> {accuracy[max(accuracy)]:.3f}", file=sys.stderr, flush=True)
    emit({"bench": "families", "tracking_uri": f"sqlite:///{root}/mlflow.db", "experiment": "families", "families": results})


if __name__ == "__main__":
    main()
