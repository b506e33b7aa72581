"""What a cluster user keeps in the object store, read by the tasks that take it: prompt files (`data.train_file` and
`data.test_file` as URIs, make_data) and the recipe itself (a FlyteFile, read_recipe). The tasks run locally here with
flytekit's file access pointed at the S3 server on loopback (tests/pods/conftest.py), so every read is a download."""

import json

import pytest
from flytekit.types.file import FlyteFile

from miles_core.config import ConfigError, DataConfig
from miles_core.data.source import DataError, load_prompts
from tasks.prepare import make_data, read_recipe

pytestmark = pytest.mark.pods


@pytest.fixture(autouse=True)
def no_local_cache(monkeypatch):
    """flytekit's local cache outlives the store (it is in HOME): every call here runs its task."""
    monkeypatch.setenv("FLYTE_LOCAL_CACHE_ENABLED", "false")


ROWS = [{"input": f"{a}+{a}=", "label": str(2 * a), "metadata": {"id": f"p{a}"}} for a in range(6)]


def stored(store, tmp_path, name: str, text: str) -> str:
    local = tmp_path / name
    local.write_text(text)
    uri = store.uri("inputs", name)
    store.files.put_data(str(local), uri)
    return uri


def test_prompt_files_named_by_uri_are_downloaded_checked_and_copied_under_the_run_root(store, tmp_path):
    lines = "".join(json.dumps(r) + "\n" for r in ROWS)
    train, test = stored(store, tmp_path, "train.jsonl", lines), stored(store, tmp_path, "test.jsonl", lines[: len(lines) // 2])
    with store.context():
        dataset = make_data(cfg=DataConfig(train_file=train, test_file=test), root=store.uri("inputs-run"))
        local = dataset.train.download()
    assert dataset.train.remote_source.startswith(store.uri("inputs-run", "data"))
    assert [p.label for p in load_prompts(local)] == [r["label"] for r in ROWS]


def test_a_bad_row_in_a_stored_prompt_file_is_named_by_its_uri(store, tmp_path):
    bad = "".join(json.dumps(r) + "\n" for r in ROWS[:2]) + '{"input": "1+1="}\n'
    train = stored(store, tmp_path, "bad.jsonl", bad)
    with store.context(), pytest.raises(DataError, match=rf"(?m)^\s*{train}: row 3: key 'label'"):
        make_data(cfg=DataConfig(train_file=train, test_file=train), root=store.uri("inputs-run"))


def test_a_recipe_in_the_store_extends_a_shipped_recipe_and_takes_overrides(store, tmp_path):
    uri = stored(store, tmp_path, "mine.yaml", "extends: smoke.yaml\nname: stored_recipe\n")
    with store.context():
        cfg = read_recipe(recipe=FlyteFile(uri), overrides=["iterations=7", "rollout.n_samples=2"])
    assert (cfg.name, cfg.iterations, cfg.rollout.n_samples, cfg.sft.steps) == ("stored_recipe", 7, 2, 150)  # sft.steps: smoke.yaml's


def test_a_misspelt_key_in_a_stored_recipe_is_named_with_the_recipes_uri(store, tmp_path):
    uri = stored(store, tmp_path, "typo.yaml", "extends: smoke.yaml\nname: typo\ntrain: {learning_rate: 0.1}\n")
    with store.context(), pytest.raises(ConfigError, match=rf"(?m)^\s*{uri}: train.learning_rate: unknown key"):
        read_recipe(recipe=FlyteFile(uri), overrides=[])
    with store.context(), pytest.raises(ConfigError, match=r"iteratons: unknown key \(did you mean iterations"):
        read_recipe(recipe=FlyteFile(uri.replace("typo", "mine")), overrides=["iteratons=3"])
