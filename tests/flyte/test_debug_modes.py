"""The debug modes through `pyflyte run` (workflows/debug.py): `rollout_only` rolls out, scores and dumps a batch of
the recipe's policy and trains nothing; `train_only` trains on that dump's JSONL, publishes a policy and, with
debug.dump_rollouts, dumps the batch again with the step's advantages and trainer log-probs. The score and train
tasks write their decks (samples, histograms, and on train the train/rollout mismatch) where the log says."""

import json
import subprocess
from collections import OrderedDict

import pandas as pd
import pytest
from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.tools.translator import get_serializable

from miles_core.batch_io import read_batch
from miles_core.dump import JSONL, PARQUET, read_rollouts
from tasks import debug as debug_tasks
from tasks import rl as rl_tasks
from tests.conftest import REPO, decks, run_workflow, workflow_command, workflow_env
from workflows.debug import rollout_only, train_only

pytestmark = pytest.mark.flyte

ROWS = 8 * 4  # smoke: prompts_per_step x n_samples


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """rollout_only, then train_only on its dump, in one run root and Flyte cache (train_only's SFT policy is a cache hit)."""
    base = tmp_path_factory.mktemp("debug")
    root, home = base / "runs", base / "home"
    rolled = run_workflow("recipes/smoke.yaml", root, home, "iterations=1", workflow=("workflows/debug.py", "rollout_only"))
    (dump,) = root.glob("dump/*/")
    stages = sorted(p.name for p in root.iterdir() if p.is_dir())  # what rollout_only left
    command = workflow_command("recipes/smoke.yaml", root, "debug.dump_rollouts=true", workflow=("workflows/debug.py", "train_only"))
    trained = subprocess.run(
        [*command, "--rollouts", json.dumps([str(dump / JSONL)])], cwd=REPO, env=workflow_env(home), capture_output=True, text=True, timeout=900
    )
    assert trained.returncode == 0, trained.stdout[-4000:] + trained.stderr[-4000:]
    return root, dump, stages, rolled.stdout + rolled.stderr, trained.stdout + trained.stderr


def test_rollout_only_dumps_the_scored_batch_and_trains_nothing(runs):
    root, dump, stages, log, _ = runs
    samples = read_rollouts(dump / JSONL)
    assert len(samples) == ROWS and {s.weight_version for s in samples} == {1}  # the SFT policy's
    # the score task's batch, and the one train_only admitted from the dump's JSONL, are the dump's samples
    assert [read_batch(p, scored=True) for p in root.glob("scored/*.parquet")] == [samples, samples]
    assert read_rollouts(dump / PARQUET) == samples
    frame = pd.read_parquet(dump / PARQUET)
    assert frame["advantages"].isna().all() and frame["response"].str.len().gt(0).any()
    assert stages == ["base", "data", "dump", "rollout", "scored", "sft"]  # no checkpoint, no policy: nothing trained
    score_deck = decks(log)["score"]
    assert "sample responses: 16 of 32" in score_deck and frame.at[0, "sample_id"] in score_deck
    assert "histograms: reward, response length (tokens)" in score_deck and score_deck.count("<svg") == 2


def test_train_only_trains_on_the_dump_and_publishes_a_policy(runs):
    root, dump, _, _, log = runs
    (policy,) = root.glob("policy/*/")
    assert json.loads((policy / "policy.json").read_text())["version"] == 2  # the SFT policy's successor
    assert [p.name[:4] for p in sorted(root.glob("checkpoint/*"))] == ["0000", "0001"]  # converted, then one step
    assert len([p for p in root.glob("rollout/*.parquet") if ".buffer" not in p.name]) == 1  # rollout_only's: train_only generated none
    (traced,) = [d for d in root.glob("dump/*/") if d != dump]
    frame = pd.read_parquet(traced / PARQUET)
    assert frame["sample_id"].tolist() == pd.read_parquet(dump / PARQUET)["sample_id"].tolist()
    for advantages, trainer, rollout in zip(frame["advantages"], frame["trainer_logprobs"], frame["rollout_logprobs"]):
        assert len(advantages) == len(trainer) == len(rollout) > 0
        assert max(abs(a - b) for a, b in zip(trainer, rollout)) < 1e-3  # the rollout's own policy, trained on in fp32
    train_deck = decks(log)["train"]
    assert "train/rollout mismatch" in train_deck and "mismatch/kl_rollout_train" in train_deck
    assert "trainer - rollout log-prob per token" in train_deck and "mean advantage" in train_deck


def test_the_debug_workflows_compile_for_a_cluster_and_their_tasks_are_cached():
    settings = SerializationSettings(image_config=ImageConfig(default_image=Image(name="default", fqn="ghcr.io/miles-flyte/default", tag="v0")))
    assert set(get_serializable(OrderedDict(), settings, rollout_only).template.interface.inputs) == {"cfg"}
    assert set(get_serializable(OrderedDict(), settings, train_only).template.interface.inputs) == {"cfg", "rollouts"}
    for task in (debug_tasks.dump, debug_tasks.admit_rollouts):
        assert get_serializable(OrderedDict(), settings, task).template.metadata.discoverable
    assert "debug" in get_serializable(OrderedDict(), settings, rl_tasks.train).template.interface.inputs
