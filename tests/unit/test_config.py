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


def test_seed_override_sets_every_seeded_section_before_their_own_seeds(tmp_path):
    cfg = load_recipe(write(tmp_path, "name: t\nsft: {seed: 5}\n"), {"seed": 3, "rollout.seed": 9})
    assert {s: getattr(cfg, s).seed for s in ("model", "data", "sft", "rollout", "train")} == {"model": 3, "data": 3, "sft": 3, "rollout": 9, "train": 3}


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
        ("train: {memory_gb: -8}\n", "train.memory_gb: must be >= 0"),
        ("train: {nnodes: 2, nproc_per_node: 4, tensor_parallel: 8}\n", "train.tensor_parallel: must divide nproc_per_node = 4"),
        ("train: {nnodes: 2, nproc_per_node: 2, pipeline_parallel: 2, expert_parallel: 4}\n", "train.expert_parallel: must divide nnodes x nproc_per_node"),
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
    out = subprocess.run([sys.executable, "-m", "miles_core.config", str(path)], check=False, capture_output=True, text=True, cwd=REPO)
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


FLOAT_KEYS = sorted(key for key, value in flatten(RunConfig()).items() if isinstance(value, float))


def nested(dotted: str, text: str) -> str:
    """'train.lr', '.nan' -> 'train: {lr: .nan}' (YAML flow mappings, one per level)."""
    *parents, last = dotted.split(".")
    out = f"{last}: {text}"
    for key in reversed(parents):
        out = f"{key}: {{{out}}}"
    return out + "\n"


def replaced(cfg, dotted: str, value):
    """cfg with the key at `dotted` set to value, every enclosing section rebuilt (and so checked)."""
    head, _, rest = dotted.partition(".")
    return dataclasses.replace(cfg, **{head: replaced(getattr(cfg, head), rest, value) if rest else value})


def test_every_section_has_float_keys_to_check():
    # the walk below covers each section's float keys: a regression that loses them fails here
    assert {"train.lr", "algo.log_ratio_clamp", "rollout.temperature", "rollout.sglang.bucket_mb", "reward.fallback", "async_phase.take_timeout_s"} <= set(
        FLOAT_KEYS
    )


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_nan_and_infinity_in_a_recipe_are_refused_with_the_key_path(tmp_path, key):
    for text, shown in ((".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf")):
        path = write(tmp_path, nested(key, text))
        with pytest.raises(ConfigError) as err:
            load_recipe(path)
        assert str(err.value) == f"{path}: {key}: must be a finite number, got {shown}"


# RewardConfig and MultiTurnConfig run their own range checks before the finiteness walk of RunConfig: a NaN there is
# refused by such a check (under the section's key path, maybe with that check's words); every other key names itself
OWN_CHECKS_FIRST = ("reward.", "rollout.multi_turn.")


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_nan_and_infinity_in_a_config_built_in_code_are_refused(key):
    for value in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ConfigError) as err:
            replaced(RunConfig(), key, value)
        if key.startswith(OWN_CHECKS_FIRST):
            assert str(err.value).startswith(key.rsplit(".", 1)[0] + ".")
        else:
            assert str(err.value) == f"{key}: must be a finite number, got {value}"


def test_nan_given_as_a_command_line_override_is_refused(tmp_path):
    path = write(tmp_path, "name: t\n")
    with pytest.raises(ConfigError, match=r"train\.lr: must be a finite number, got nan"):
        load_recipe(path, {"train.lr": float("nan")})


@pytest.mark.parametrize(
    "text, expected",
    [
        ("algo: {lam: 1.5}\n", "algo.lam: must be in [0, 1], got 1.5"),
        ("algo: {gamma: 0.0}\n", "algo.gamma: must be in (0, 1]"),
        ("algo: {eps_clip_low: 1.0}\n", "algo.eps_clip_low: must be in (0, 1)"),
        ("algo: {eps_clip_high: 0.0}\n", "algo.eps_clip_high: must be > 0"),
        ("algo: {entropy_coef: -0.01}\n", "algo.entropy_coef: must be >= 0"),
        ("algo: {critic_lr: 0.0}\n", "algo.critic_lr: must be > 0"),
        ("algo: {log_ratio_clamp: 0.0}\n", "algo.log_ratio_clamp: must be > 0"),
        ("algo: {log_ratio_clamp: 0.5}\n", "algo.log_ratio_clamp: must be > log(algo.is_upper) = 0.6931"),
        ("algo: {is_upper: 1.0e+10}\n", "algo.log_ratio_clamp: must be > log(algo.is_upper) = 23.03"),
        ("algo: {dual_clip: 1.0e+9, log_ratio_clamp: 20.0}\n", "algo.log_ratio_clamp: must be > log(algo.dual_clip) = 20.72"),
        ("algo: {is_lower: 1.0e-10}\n", "algo.log_ratio_clamp: must be > -log(algo.is_lower) = 23.03"),
        ("algo: {mismatch_threshold: 0.0}\n", "algo.mismatch_threshold: must be > 0 (a log-prob difference), got 0.0"),
        ("train: {dtype: float16}\n", "train.dtype: must be float32 or bfloat16, got 'float16'"),
        ("rollout: {dtype: fp8}\n", "rollout.dtype: must be float32 or bfloat16, got 'fp8'"),
        ("train: {beta2: 1.0}\n", "train.beta2: must be in [0, 1)"),
        ("train: {weight_decay: -0.1}\n", "train.weight_decay: must be >= 0"),
        ("train: {seed: -1}\n", "train.seed: must be >= 0"),
        ("evaluation: {batch_size: 0}\n", "evaluation.batch_size: must be > 0"),
        ("evaluation: {max_new_tokens: 0}\n", "evaluation.max_new_tokens: must be > 0"),
        ("rollout: {temperature: 0.0}\n", "rollout.temperature: must be > 0"),
        ("rollout: {sglang: {dtype: fp8}}\n", "rollout.sglang.dtype: must be one of auto, half, float16, bfloat16, float, float32"),
        ("async_phase: {take_timeout_s: 0.0}\n", "async_phase.take_timeout_s: must be > 0 seconds"),
        ("async_phase: {trainer_cpus: -1.0}\n", "async_phase.trainer_cpus: must be >= 0"),
        ("data: {test_size: 0}\n", "data.test_size: must be > 0"),
        ("data: {teacher_carry_error: 1.5}\n", "data.teacher_carry_error: must be in [0, 1]"),
        ("sft: {warmup_steps: -1}\n", "sft.warmup_steps: must be >= 0"),
        ("model: {seed: -1}\n", "model.seed: must be >= 0"),
    ],
)
def test_values_outside_a_keys_meaning_name_the_key(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    assert str(err.value).startswith(f"{path}: {expected}")


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "{}\n"])
def test_an_empty_recipe_is_refused(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=r"recipe\.yaml is empty: write the keys it overrides"):
        load_recipe(path)


def test_an_empty_extended_recipe_is_refused_by_name(tmp_path):
    (tmp_path / "base.yaml").write_text("")
    with pytest.raises(ConfigError, match=r"recipe\.yaml: base\.yaml is empty"):
        load_recipe(write(tmp_path, "extends: base.yaml\nname: t\n"))
