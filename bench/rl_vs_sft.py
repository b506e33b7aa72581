"""Is the gain from RL, or from an under-trained start? Prints one JSON object.

Runs the RL workflow on a recipe (fresh cache and run root), takes the wall time of its RL phase
(the MLflow run: from the start evaluation to the final report), then gives the same SFT start
that much wall time of further SFT on the same demonstrations (the recipe's SFT settings, its
warm-up + cosine schedule stretched to the number of steps that fit) and evaluates both on the
same held-out prompts.

    python bench/rl_vs_sft.py [--recipe recipes/tiny_arith_cpu.yaml]
"""

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from measure import emit
from runner import metric, mlflow_runs, run_workflow
from transformers import AutoTokenizer

from miles_core.config import load_recipe
from miles_core.data.source import load_prompts
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.step import bind, evaluate
from miles_core.train.sft import demonstrations, run_sft, sft_train_config
from miles_core.train.torch_backend import TorchTrainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/tiny_arith_cpu.yaml")
    args = parser.parse_args()
    cfg = load_recipe(args.recipe)
    with tempfile.TemporaryDirectory() as tmp:
        run_workflow(args.recipe, Path(tmp) / "runs", tmp)
        client, (run,) = mlflow_runs(Path(tmp) / "runs")
        rl_seconds = (run.info.end_time - run.info.start_time) / 1000
        accuracy = metric(client, run, "eval_accuracy")
        start_dir = run.data.tags["parent_policy_dir"]
        data_dir = Path(start_dir).parents[1] / "data"
        train_file, test_file = (next(data_dir.glob(f"*/{split}.jsonl")) for split in ("train", "test"))

        tokenizer = AutoTokenizer.from_pretrained(start_dir)
        demos = demonstrations(load_prompts(train_file), tokenizer)
        probe = TorchTrainer.from_hf(start_dir, sft_train_config(cfg.sft))
        started = time.monotonic()
        run_sft(probe, demos, replace(cfg.sft, steps=20), tokenizer.pad_token_id)
        steps = int(rl_seconds / ((time.monotonic() - started) / 20))
        trainer = TorchTrainer.from_hf(start_dir, sft_train_config(cfg.sft))
        started = time.monotonic()
        run_sft(trainer, demos, replace(cfg.sft, steps=steps), tokenizer.pad_token_id, deadline=started + rl_seconds)
        sft_seconds = time.monotonic() - started
        out = Path(tmp) / "further_sft"
        trainer.export_hf(str(out), "float32")
        tokenizer.save_pretrained(out)
        evaluation = evaluate(TorchEngine(str(out)), load_prompts(test_file), tokenizer, bind(reward=cfg.reward, evaluation=cfg.evaluation))
    emit(
        {
            "bench": "rl_vs_sft",
            "recipe": args.recipe,
            "heldout_prompts": int(evaluation["eval/prompts"]),
            "accuracy_sft_start": accuracy[0],
            "accuracy_after_rl": accuracy[max(accuracy)],
            "rl_phase_s": round(rl_seconds, 1),
            "accuracy_after_further_sft": evaluation["eval/accuracy"],
            "further_sft_s": round(sft_seconds, 1),
            "further_sft_steps": steps,
            "rl_curve": [round(accuracy[k], 3) for k in sorted(accuracy)],
        }
    )


if __name__ == "__main__":
    main()
