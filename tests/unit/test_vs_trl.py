"""bench/vs_trl.py's own arithmetic: the recipe mapped onto TRL's GRPOConfig, time to each accuracy target from
evaluation points, accuracy at the same time, and the choice of TRL's best learning rate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from miles_core.config import load_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import vs_trl  # noqa: E402 (a benchmark script, importable from its own folder)


def test_the_main_recipe_is_one_generation_batch_of_two_optimizer_steps():
    settings = vs_trl.trl_settings(load_recipe("recipes/tiny_arith_cpu.yaml"))
    # 64 prompts x 8 samples per generation, split into train.mini_batches = 2 optimizer steps of 256 completions
    assert settings["num_generations"] == 8 and settings["steps_per_generation"] == 2
    assert settings["per_device_train_batch_size"] == 256 and settings["gradient_accumulation_steps"] == 1
    assert (settings["max_completion_length"], settings["temperature"], settings["top_k"]) == (6, 1.0, 0)
    assert (settings["epsilon"], settings["epsilon_high"], settings["beta"]) == (0.2, 0.28, 0.0)
    assert (settings["loss_type"], settings["scale_rewards"]) == ("bnpo", "group")  # token mean over each mini-batch
    assert (settings["warmup_steps"], settings["adam_beta2"], settings["max_grad_norm"]) == (5, 0.99, 1.0)


def test_a_step_trl_does_not_compute_is_refused_naming_every_key():
    cfg = load_recipe("recipes/dapo.yaml", {"algo.kl_coef": 0.1, "algo.policy_loss": "gspo"})
    with pytest.raises(ValueError, match="rollout.dynamic_sampling, algo.policy_loss, algo.kl_coef"):
        vs_trl.trl_settings(cfg)


def points(*rows: tuple[float, float, float]) -> list[dict]:
    return [{"rl_s": rl, "total_s": total, "accuracy": acc} for rl, total, acc in rows]


OURS = points((0, 0, 0.5), (2, 10, 0.65), (4, 14, 0.75), (6, 18, 0.9))
TRL = points((0, 0, 0.5), (5, 8, 0.62), (10, 12, 0.7), (15, 16, 0.78), (20, 20, 0.79))


def test_time_to_each_target_is_the_first_evaluation_at_or_above_it():
    rows = vs_trl.comparison(OURS, TRL, [0.6, 0.7, 0.8])["time_to_target"]
    assert [r["ours_rl_s"] for r in rows] == [2, 4, 6] and [r["trl_rl_s"] for r in rows] == [5, 10, None]
    assert [r["ours_total_s"] for r in rows] == [10, 14, 18] and [r["trl_total_s"] for r in rows] == [8, 12, None]
    assert [r["ratio_rl_s"] for r in rows] == [0.4, 0.4, None]  # None: TRL never reached 0.8
    assert [r["ratio_total_s"] for r in rows] == [1.25, 1.167, None]


def test_accuracy_at_the_same_time_is_each_sides_last_evaluation_by_then():
    same = vs_trl.comparison(OURS, TRL, [0.6])["accuracy_at_same_time"]
    assert same["rl_s"] == {"seconds": 6, "ours": 0.9, "trl": 0.62}  # ours stopped first on the RL-step clock
    assert same["total_s"] == {"seconds": 18, "ours": 0.9, "trl": 0.78}


def test_the_best_learning_rate_reaches_more_targets_then_the_hardest_sooner():
    runs = {1e-4: points((0, 0, 0.5), (9, 9, 0.71)), 5e-4: points((0, 0, 0.5), (3, 3, 0.65), (6, 6, 0.72)), 1e-3: points((0, 0, 0.5), (2, 2, 0.69))}
    assert vs_trl.best_run(runs, [0.6, 0.7]) == 5e-4
    assert vs_trl.best_run(runs, [0.6]) == 1e-3
