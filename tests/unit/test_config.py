"""Recipes: defaults, overrides, and bad recipes failing with the file and key path."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.config import ConfigError, RunConfig, config_hash, flatten, load_recipe

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_every_recipe_in_the_repo_loads():
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert recipes
    for recipe in recipes:
        assert isinstance(load_recipe(recipe), RunConfig)


def test_overrides_only_change_what_they_name(tmp_path):
    cfg = load_recipe(write(tmp_path, "name: t\ntrain: {lr: 0.01}\n"))
    assert cfg.train.lr == 0.01
    assert cfg.train.grad_clip == RunConfig().train.grad_clip
    assert cfg.rollout == RunConfig().rollout
    assert Path(cfg.run_root).is_absolute()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("trian: {lr: 0.1}\n", "trian: unknown key"),
        ("train: {lrr: 0.1}\n", "train.lrr: unknown key"),
        ("train: {lr: fast}\n", "train.lr: expected float, got str 'fast'"),
        ("rollout: {n_samples: 2.5}\n", "rollout.n_samples: expected int"),
        ("algo: {normalize_std: 1}\n", "algo.normalize_std: expected bool"),
        ("rollout: {top_p: 1.5}\n", "rollout.top_p: must be in (0, 1]"),
        ("train: {lr: -1}\n", "train.lr: must be > 0"),
        ("model: {hidden_size: 130, num_heads: 4}\n", "model.hidden_size: must be divisible by num_heads"),
        ("rollout: 3\n", "rollout: expected a mapping"),
        ("iterations: 0\n", "iterations: must be >= 1"),
        ("algo: {advantage: ppo2}\n", "algo.advantage: unknown estimator 'ppo2'"),
        ("rollout: {n_samples: 1}\nalgo: {advantage: rloo}\n", "algo.advantage: rloo needs rollout.n_samples >= 2"),
        ("rollout: {engine: sglang, sglang: {urls: 'http://h:1'}}\nasync_phase: {schedule: async}\n", "async_phase.rollout_workers: attached SGLang servers"),
        ("train: [lr\n", "not valid YAML"),
    ],
)
def test_bad_recipe_names_file_and_key(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    assert str(path) in str(err.value)
    assert expected in str(err.value)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_cli_prints_json_that_round_trips(tmp_path):
    path = write(tmp_path, "name: cli\niterations: 3\n")
    out = subprocess.run([sys.executable, "-m", "miles_core.config", str(path), "train.lr=0.5"], capture_output=True, text=True, cwd=REPO, check=True)
    values = json.loads(out.stdout)
    assert values["iterations"] == 3 and values["train"]["lr"] == 0.5 and values["name"] == "cli"


def test_cli_rejects_bad_recipe_with_exit_2(tmp_path):
    path = write(tmp_path, "train: {lr: 0}\n")
    out = subprocess.run([sys.executable, "-m", "miles_core.config", str(path)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2
    assert "train.lr: must be > 0" in out.stderr and out.stdout == ""


def test_hash_and_flatten_follow_values():
    a, b = RunConfig(), dataclasses.replace(RunConfig(), iterations=7)
    assert config_hash(a) == config_hash(RunConfig()) != config_hash(b)
    flat = flatten(a)
    assert flat["train.lr"] == a.train.lr and flat["rollout.n_samples"] == a.rollout.n_samples


def test_extends_merges_sections_key_by_key(tmp_path):
    (tmp_path / "base.yaml").write_text("name: base\niterations: 4\ntrain: {lr: 0.01, mini_batches: 3}\n")
    (tmp_path / "mid.yaml").write_text("extends: base.yaml\ntrain: {lr: 0.02}\n")
    cfg = load_recipe(write(tmp_path, "extends: mid.yaml\nname: top\n"))
    assert (cfg.name, cfg.iterations, cfg.train.lr, cfg.train.mini_batches) == ("top", 4, 0.02, 3)


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"recipe.yaml": "extends: missing.yaml\n"}, "missing.yaml not found"),
        ({"recipe.yaml": "extends: a.yaml\n", "a.yaml": "extends: recipe.yaml\n"}, "extended in a cycle"),
        ({"recipe.yaml": "extends: a.yaml\n", "a.yaml": "train: {lrr: 1}\n"}, "train.lrr: unknown key"),
    ],
)
def test_bad_extends_names_the_file(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as err:
        load_recipe(tmp_path / "recipe.yaml")
    assert str(tmp_path / "recipe.yaml") in str(err.value) and expected in str(err.value)
