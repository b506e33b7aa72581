"""A real local execution of the RL workflow: it trains, logs to MLflow (its policies in the model registry), starts from
a user's checkpoint, and resumes after a kill."""

import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from miles_core import tracking
from miles_core.batch_io import read_batch
from miles_core.models.source import checkpoint_digest, read_source
from miles_core.storage import sha256_file
from miles_core.weights.manifest import weights_sha256
from tests.conftest import REPO, deck_files, decks, final_policy, run_workflow, workflow_command, workflow_env

pytestmark = pytest.mark.flyte


def test_run_trains_and_tracks(smoke_run):
    root, out = smoke_run
    policy = final_policy(root)
    sft_start = next((root / "sft").glob("*/model.safetensors"))
    assert sha256_file(policy / "model.safetensors") != sha256_file(sft_start)  # parameters changed
    assert "held-out greedy accuracy: before RL" in out.stdout

    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [1, 2, 3]
    assert len(client.get_metric_history(run.info.run_id, "eval_accuracy")) == 4  # SFT start + 3 iterations
    for key in ("train_loss", "train_clip_fraction", "train_entropy", "mismatch_abs_logprob_diff", "rollout_tokens_per_s", "time_train_s"):
        assert key in run.data.metrics
    for stage in ("rollout", "score", "train"):  # each task's whole body holds its compute and its own I/O
        assert run.data.metrics[f"time_{stage}_task_s"] >= run.data.metrics[f"time_{stage}_s"] > 0
    assert run.data.params["rollout.n_samples"] == "4"
    assert run.data.tags["policy_version"] == "4" and run.data.tags["parent_version"] == "1"
    assert {"config_hash", "data_hash", "flyte.execution_id", "policy_sha256"} <= set(run.data.tags)
    (base,) = root.glob("base/*/")
    assert run.data.tags["model.source"] == "tiny:qwen2:seed=0" and run.data.tags["model.sha256"] == checkpoint_digest(base)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "policies")}
    assert artifacts == {f"policies/v{v:04d}.json" for v in (1, 2, 3, 4)}  # the SFT start and each iteration's
    assert any(a.path.endswith("reward_curve.png") for a in client.list_artifacts(run.info.run_id))


def test_each_tasks_decks_are_rendered_once(smoke_run):
    """The train task's deck holds its own batch table once: its forked rank-0 worker hands back only the decks it
    made, not those it inherited (flytekit's Elastic plugin appends every deck rank 0 returns)."""
    _, out = smoke_run
    assert decks(out.stdout + out.stderr)["train"].count("sample responses:") == 1


def test_a_tasks_deck_holds_its_own_run_only(smoke_run):
    """A score deck holds that task's own content: from the second iteration on (whose inputs carry a trained policy's
    metrics) it is about the size of the one before (flytekit's timeline deck, one per process in a local run, once
    listed the phases of every task run before it: the third 9% larger than the second)."""
    _, out = smoke_run
    sizes = [Path(path).stat().st_size for task, path in deck_files(out.stdout + out.stderr) if task == "score"]
    assert len(sizes) == 3 and sizes[2] < 1.02 * sizes[1], sizes


def test_every_published_policy_is_a_registered_version_that_loads_back(smoke_run, tmp_path):
    """The SFT start and each iteration's policy are versions of `smoke-policy`, sourced from the published directory
    and tagged with their lineage; iteration N of the run loads back with exactly the weights published as v(N + 1)."""
    root, _ = smoke_run
    uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    versions = client.search_model_versions("name = 'smoke-policy'")
    lineage = sorted((int(v.tags["iteration"]), int(v.tags["policy_version"]), int(v.tags["parent_version"])) for v in versions)
    assert lineage == [(0, 1, 0), (1, 2, 1), (2, 3, 2), (3, 4, 3)]
    published = {json.loads(p.read_text())["version"]: p.parent for p in [*root.glob("sft/*/policy.json"), *root.glob("policy/*/policy.json")]}
    for version in versions:
        assert version.run_id == run.info.run_id and version.source == version.tags["policy_dir"]
        assert os.path.samefile(version.source, published[int(version.tags["policy_version"])])
        assert {k: version.tags[k] for k in tracking.RUN_LINEAGE} == {k: run.data.tags[k] for k in tracking.RUN_LINEAGE}
    for iteration in (0, 3):
        loaded = tracking.load_policy(uri, "smoke-policy", run_id=run.info.run_id, iteration=iteration, dst_path=str(tmp_path / str(iteration)))
        state = AutoModelForCausalLM.from_pretrained(loaded).state_dict()
        weights = load_file(published[iteration + 1] / "model.safetensors")
        assert all(torch.equal(state[name], tensor) for name, tensor in weights.items())


def test_run_from_a_checkpoint_path_resumes_after_a_kill_to_the_same_weights(smoke_run, tmp_path):
    """The second run starts from a user's checkpoint (model.path: the first run's tiny base, saved as any HF
    directory is); it is killed mid-run and resumed, and ends on the same weights, bit for bit, as the first."""
    root_a, _ = smoke_run
    (checkpoint,) = root_a.glob("base/*/")
    root, home, args = tmp_path / "runs", tmp_path / "home", ("iterations=3", f"model.path={checkpoint}")
    proc = subprocess.Popen(
        workflow_command("recipes/smoke.yaml", root, *args),
        cwd=REPO,
        env=workflow_env(home),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    while not list(root.glob("checkpoint/0002-*")):  # the train task of iteration 2 has finished
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not list(root.glob("policy/0004-*"))  # killed before the end

    resumed = run_workflow("recipes/smoke.yaml", root, home, *args)
    log = resumed.stdout + resumed.stderr
    assert log.count("Cache hit") >= 9  # model, admission, data, sft, evaluate, convert, rollout/score/train of iteration 1 ...
    assert sha256_file(final_policy(root) / "model.safetensors") == sha256_file(final_policy(root_a) / "model.safetensors")
    (base,) = root.glob("base/*/")
    assert read_source(base) == {"path": str(checkpoint), "sha256": checkpoint_digest(checkpoint)}


def test_a_tripped_health_gate_stops_the_run_keeps_what_was_published_and_marks_the_mlflow_run(tmp_path):
    """health.max_grad_norm far below any step's: the first RL step trips it. The run fails naming the gate, its value
    and its threshold; the step's checkpoint is never written, so the SFT policy stays the last published one; the
    workflow's failure handler ends the MLflow run FAILED, tagged with the gate."""
    root = tmp_path / "runs"
    command = workflow_command("recipes/smoke.yaml", root, "iterations=1", "health.max_grad_norm=1.0e-9")
    out = subprocess.run(command, cwd=REPO, env=workflow_env(tmp_path / "home"), capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert re.search(r"health gate grad_norm tripped at [0-9.]+ \(health.max_grad_norm is 1e-09\)", log), log[-3000:]
    assert [p.name[:4] for p in root.glob("checkpoint/*")] == ["0000"] and not list(root.glob("policy/*"))  # converted only
    assert len(list(root.glob("sft/*/model.safetensors"))) == 1

    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["health_gate"] == "grad_norm"
    assert "health.max_grad_norm is 1e-09" in run.data.tags["failure.message"]


def test_fp8_rollout_runs_the_loop_and_raises_the_measured_mismatch(smoke_run, tmp_path):
    """publish.quantization=fp8: the policy of iteration 1 is published in FP8 blocks and rolls out iteration 2 in the
    embedded engine (dequantized); the trainer stays fp32. Iteration 1 is the same as the smoke run's (its rollout is
    the SFT policy's), so iteration 2's train/rollout mismatch is compared on the same weights, with and without FP8."""
    root = tmp_path / "runs"
    run_workflow("recipes/smoke.yaml", root, tmp_path / "home", "iterations=2", "publish.quantization=fp8")
    policy = final_policy(root)
    assert json.loads((policy / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"

    def mismatch_at_iteration_2(runs):
        client = MlflowClient(tracking_uri=f"sqlite:///{runs}/mlflow.db")
        (run,) = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, "mismatch_abs_logprob_diff")}[2]

    quantized, plain = mismatch_at_iteration_2(root), mismatch_at_iteration_2(smoke_run[0])
    assert math.isfinite(quantized) and quantized > 10 * plain


def test_routing_replay_stores_the_rollouts_experts_with_its_batch_and_replays_them(tmp_path):
    """rollout.routing_replay on an MoE smoke model: the rollout task's batch (what the score and train pods download)
    carries every sample's experts, and each training step replays them: the agreement it logs is 1 (rollout and
    trainer hold the same weights in fp32), and the run learns on as without replay."""
    root = tmp_path / "runs"
    run_workflow("recipes/smoke.yaml", root, tmp_path / "home", "iterations=1", "sft.steps=10", "model.arch=qwen3_moe", "rollout.routing_replay=true")
    (scored,) = root.glob("scored/*.parquet")
    samples = read_batch(scored, scored=True)
    assert all(len(s.routed_experts) == (len(s.prompt_tokens) + len(s.response_tokens) - 1) * 2 * 2 for s in samples)  # 2 layers, top-2
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    assert run.data.metrics["routing_agreement"] == 1.0 and math.isfinite(run.data.metrics["train_loss"])


def test_lora_publishes_the_adapter_alone_and_rolls_it_out_over_the_sft_base(tmp_path):
    """train.lora.rank=4 through the tasks: every checkpoint and published version holds the adapter alone (PEFT's
    files, no model weights), each version's manifest names the SFT policy as its base by sha256, and iteration 2's
    rollout task generates with version 2, the adapter over that base, both its inputs (docs/lora.md)."""
    root = tmp_path / "runs"
    run_workflow("recipes/smoke.yaml", root, tmp_path / "home", "iterations=2", "sft.steps=10", "train.lora.rank=4")
    (sft_policy,) = root.glob("sft/*/")
    for directory in [*root.glob("checkpoint/*/"), *root.glob("policy/*/")]:
        assert (directory / "adapter_model.safetensors").is_file() and not list(directory.glob("model*.safetensors")), directory
    manifests = sorted((json.loads(p.read_text()) for p in root.glob("policy/*/policy.json")), key=lambda m: m["version"])
    assert [(m["version"], m["adapter"], m["base_sha256"]) for m in manifests] == [(v, "peft-lora", weights_sha256(sft_policy)) for v in (2, 3)]
    versions = [{s.weight_version for s in read_batch(p)} for p in sorted(root.glob("rollout/*[0-9a-f].parquet"))]
    assert versions == [{1}, {2}]  # the SFT policy, then the first adapter
