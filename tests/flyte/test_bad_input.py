"""Bad input through the real workflow: a clear error naming file, row and key, and nothing under
the run root lost."""

import json
import re
import subprocess
import sys

import pytest

from miles_core.storage import sha256_file
from tests.conftest import REPO, workflow_command, workflow_env

pytestmark = pytest.mark.flyte


def snapshot(root):
    return {p: sha256_file(p) for p in root.rglob("*") if p.is_file() and p.name != "mlflow.db" and not p.name.startswith(".")}


def test_malformed_prompt_file_fails_naming_row_and_key_and_keeps_the_run_root(smoke_run, tmp_path):
    root, _ = smoke_run
    before = snapshot(root)
    good = {"input": "1+2=", "label": "3", "metadata": {"id": "a"}}
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps(good) + "\n" + json.dumps({"input": "   ", "label": "4"}) + "\n")
    test = tmp_path / "test.jsonl"
    test.write_text(json.dumps(good) + "\n")
    out = subprocess.run(
        workflow_command("recipes/smoke.yaml", root, f"data.train_file={train}", f"data.test_file={test}"),
        cwd=REPO,
        env=workflow_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode != 0
    log = " ".join((out.stdout + out.stderr).split())
    assert f"{train}: row 2" in log and "'input'" in log and "empty" in log
    assert snapshot(root) == before


def test_malformed_recipe_stops_before_any_task(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("rollout: {n_samples: -3}\n")
    out = subprocess.run([sys.executable, "-m", "miles_core.config", str(recipe)], cwd=REPO, capture_output=True, text=True, check=False)
    assert out.returncode == 2 and f"{recipe}: rollout.n_samples: must be > 0" in out.stderr


def test_make_run_refuses_a_bad_recipe(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("train: {lr: zero}\n")
    out = subprocess.run(["make", "run", f"RECIPE={recipe}"], cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode != 0 and "train.lr: expected float" in out.stderr
    assert "Running Execution" not in out.stdout  # pyflyte never started


def test_pyflyte_refuses_a_misspelt_key_in_the_json_config_before_anything_runs(tmp_path):
    """`--cfg` JSON is read by flytekit's command line through RunConfig.from_json: checked like a recipe, by key path."""
    command = workflow_command("recipes/smoke.yaml", tmp_path / "runs")
    values = json.loads(command[-1])
    values["rollout"]["sglang"]["tensor_paralel"] = 2
    out = subprocess.run(
        [*command[:-1], json.dumps(values)], cwd=REPO, env=workflow_env(tmp_path / "home"), capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode != 0
    assert "rollout.sglang.tensor_paralel: unknown key (known: " in " ".join((out.stdout + out.stderr).split())
    assert "Running Execution" not in out.stdout and not (tmp_path / "runs").exists()  # no task started


def test_a_batch_outside_the_models_vocabulary_or_in_split_groups_fails_the_score_task(tmp_path, monkeypatch):
    """The score task reads its batch against the model's vocabulary (its config's vocab_size, not
    len(tokenizer)) and rollout.n_samples: a token the model cannot emit, or a group cut in two, fails
    the task naming the check and the file, and leaves the file as it was."""
    from flytekit.types.directory import FlyteDirectory
    from flytekit.types.file import FlyteFile
    from transformers import AutoConfig

    from miles_core.config import HooksConfig, ModelConfig, RewardConfig, RolloutConfig
    from miles_core.data.source import DataState
    from miles_core.models.tiny import build_tiny_model
    from miles_core.samples import Sample, to_frame
    from tasks.common import Policy, RolloutResult
    from tasks.rl import score

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # a private Flyte cache
    policy = build_tiny_model(ModelConfig(num_layers=1), str(tmp_path / "policy"))
    vocab = AutoConfig.from_pretrained(policy).vocab_size
    rollout = RolloutConfig(n_samples=2)
    cases = {
        "vocab": (f"ids_below_vocab_size({vocab})", [(f"p{i // 2}", i % 2, vocab if i == 3 else 5) for i in range(4)]),
        "groups": ("whole_groups_of(2)", [("p0", 0, 5), ("p0", 1, 5), ("p1", 0, 5), ("p2", 1, 5)]),
    }
    for name, (check, rows) in cases.items():
        path = tmp_path / f"{name}.parquet"
        to_frame([Sample(p, i, [5, 6], [token, 7], [-0.5, -0.5], [1, 1], "stop", 0, "1", {}) for p, i, token in rows]).to_parquet(path)
        before = sha256_file(path)
        with pytest.raises(Exception, match=rf"{path.name}: .*check {re.escape(repr(check))} failed"):
            score(
                cfg=RewardConfig(),
                hooks=HooksConfig(),
                rollout=rollout,
                policy=Policy(dir=FlyteDirectory(policy), version=0),
                batch=RolloutResult(batch=FlyteFile(str(path)), state=DataState(), metrics={}),
                iteration=0,
                root=str(tmp_path / "runs"),
                code="",
            )
        assert sha256_file(path) == before
