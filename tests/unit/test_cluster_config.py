"""The cluster section (retries, timeouts, GPU type, elastic restarts, loop blocks, checkpoints kept, notifications) and the JSON path
of a RunConfig (what `pyflyte run --cfg` reads): every key checked, every misspelt key refused by its path."""

import dataclasses
import json

import pytest

from miles_core.config import ClusterConfig, ConfigError, RunConfig, load_recipe


def test_a_stage_timeout_is_read_in_seconds():
    cfg = ClusterConfig(train_timeout_min=90)
    assert cfg.timeout_s("train") == 5400 and cfg.timeout_s("rollout") == 60 * ClusterConfig().rollout_timeout_min


@pytest.mark.parametrize(
    "values, message",
    [
        ({"retries": -1}, "cluster.retries: must be in [0, 10]"),
        ({"accelerator": "h100"}, "cluster.accelerator: unknown GPU type 'h100' (available: nvidia-h100, nvidia-h200"),
        ({"score_timeout_min": 0}, "cluster.score_timeout_min: must be in [1, 10080] minutes"),
        ({"async_timeout_min": 10081}, "cluster.async_timeout_min: must be in [1, 10080] minutes"),
        ({"max_restarts": -1}, "cluster.max_restarts: must be in [0, 100]"),
        ({"rdzv_join_timeout_s": 0}, "cluster.rdzv_join_timeout_s: must be >= 1 second"),
        ({"block_iterations": 0}, "cluster.block_iterations: must be in [1, 200]"),
        ({"keep_checkpoints": -1}, "cluster.keep_checkpoints: must be >= 0 (0 keeps every checkpoint)"),
        ({"keep_checkpoints": 2, "keep_checkpoints_every": -5}, "cluster.keep_checkpoints_every: must be >= 0"),
        ({"keep_checkpoints_every": 20}, "cluster.keep_checkpoints_every: keeps every checkpoint already (cluster.keep_checkpoints is 0)"),
        ({"keep_policies": False}, "cluster.keep_policies: false prunes a policy with its checkpoint, and cluster.keep_checkpoints is 0"),
        ({"failure_emails": "ops@example.com, oncall"}, "cluster.failure_emails: 'oncall' is not an e-mail address"),
    ],
)
def test_values_outside_a_keys_meaning_name_the_key(values, message):
    with pytest.raises(ConfigError) as err:
        ClusterConfig(**values)
    assert str(err.value).startswith(message)


def test_failure_emails_are_a_comma_separated_list():
    assert ClusterConfig(failure_emails=" a@x.org,b@y.io ,").emails() == ["a@x.org", "b@y.io"]
    assert ClusterConfig().emails() == []


def json_of(cfg: RunConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def test_json_round_trips():
    cfg = dataclasses.replace(RunConfig(), iterations=7, cluster=ClusterConfig(retries=4, accelerator=""))
    assert RunConfig.from_json(json.dumps(json_of(cfg))) == cfg


@pytest.mark.parametrize(
    "path, key, meant",
    [
        ((), "iteratons", "iterations"),
        (("train",), "lrr", "lr"),
        (("rollout", "sglang"), "tensor_paralel", "tensor_parallel"),
        (("cluster",), "retry", "retries"),
    ],
)
def test_a_misspelt_json_key_anywhere_is_refused_by_its_path(path, key, meant):
    values = json_of(RunConfig())
    section = values
    for name in path:
        section = section[name]
    section[key] = 1
    with pytest.raises(ConfigError) as err:
        RunConfig.from_json(json.dumps(values))
    message = str(err.value)
    assert message.startswith(f"{'.'.join((*path, key))}: unknown key (did you mean ") and meant in message.split("did you mean ")[1]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"iterations": "3"}', "iterations: expected int, got str '3'"),
        ('{"train": 3}', "train: expected a mapping, got int"),
        ("[1]", "recipe: expected a mapping, got list"),
        ('{"iterations": 3', "the config is not valid JSON"),
        ('{"cluster": {"retries": 11}}', "cluster.retries: must be in [0, 10]"),
    ],
)
def test_bad_json_names_what_is_wrong(text, message):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_json(text)
    assert str(err.value).startswith(message)


def test_an_object_store_run_root_stays_a_uri(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("name: t\nrun_root: s3://bucket/runs\n")
    assert load_recipe(path).run_root == "s3://bucket/runs"
    path.write_text("name: t\nrun_root: runs\n")
    assert load_recipe(path, resolve_root=False).run_root == "runs"
    assert load_recipe(path).run_root == str(tmp_path.cwd() / "runs")
