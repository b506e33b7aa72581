"""workflows/convert.py with every task run as a Flyte pod runs it (tests/pods/emulator.py).

Emulated: flytepropeller's node order and bindings, datacatalog's cache, the pod's process and disk. Real: the
compiled spec, `pyflyte-execute` with each template's container args, flytekit's uploads and downloads, and an S3
server on loopback, the only thing the pods share. The run root is a URI in that store.
"""

import json
from pathlib import Path

import pytest
import torch
from flytekit.core.type_engine import TypeEngine
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from miles_core.config.recipe import load_recipe
from tasks.common import Checkpoint, Policy
from tests.pods import leaky
from tests.pods.emulator import CONFINED, REPO, PodFailed
from workflows.convert import convert

pytestmark = pytest.mark.pods

TASKS = ["tasks.prepare.base_model", "tasks.prepare.admit_model", "tasks.rl.convert", "tasks.rl.publish"]


@pytest.fixture(scope="module")
def runs(store, cluster):
    """The conversion run twice on the tiny model with the same config, then once with publish.dtype changed."""
    cfg = load_recipe("recipes/smoke.yaml", {"run_root": store.uri("runs")})
    first, again = cluster.run(convert, cfg=cfg), cluster.run(convert, cfg=cfg)
    changed = cluster.run(convert, cfg=load_recipe("recipes/smoke.yaml", {"run_root": store.uri("runs"), "publish.dtype": "bfloat16"}))
    return first, again, changed


def downloaded(store, literal, python_type, dest: Path):
    """An output artifact (Policy or Checkpoint) converted and downloaded as a task in another pod would: (value, local dir)."""
    with store.context() as ctx:
        value = TypeEngine.to_python_value(ctx, literal, python_type)
        store.files.get_data(value.dir.remote_source, str(dest), is_multipart=True)
    return value, dest


def test_every_task_ran_in_its_own_pod_and_left_its_artifacts_in_the_store(store, runs):
    first, _, _ = runs
    assert first.nodes == {"n0": "ran", "n1": "ran", "n2": "ran", "n3": "ran"}
    assert list(first.tasks.values()) == TASKS
    for name in ("checkpoint", "exported"):
        uri = first.outputs.literals[name].scalar.binary  # a dataclass (msgpack) holding the artifact's URI
        assert store.uri("runs") in uri.value.decode("latin-1")
    stages = {key.removeprefix(store.uri("runs") + "/").split("/")[0] for key in store.keys(store.uri("runs"))}
    assert stages == {"base", "checkpoint", "policy"}


def test_the_published_checkpoint_from_the_store_loads_and_equals_the_base(store, runs, tmp_path):
    first, _, _ = runs
    policy, exported = downloaded(store, first.outputs.literals["exported"], Policy, tmp_path / "exported")
    checkpoint, _ = downloaded(store, first.outputs.literals["checkpoint"], Checkpoint, tmp_path / "checkpoint")
    (base_uri,) = {k.rsplit("/", 1)[0] for k in store.keys(store.uri("runs", "base"))}
    store.files.get_data(base_uri, str(tmp_path / "base"), is_multipart=True)

    assert AutoModelForCausalLM.from_pretrained(exported).config.model_type == "qwen2"
    before, after = load_file(tmp_path / "base" / "model.safetensors"), load_file(exported / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    manifest = json.loads((exported / "policy.json").read_text())
    assert policy.version == 1 and manifest["parent_version"] == 0
    assert manifest["source"] == checkpoint.dir.remote_source  # lineage names the store, not a pod's disk


def test_a_second_run_hits_the_cache_for_every_task(runs):
    first, again, _ = runs
    assert again.nodes == {"n0": "cache hit", "n1": "cache hit", "n2": "cache hit", "n3": "cache hit"}
    assert again.outputs == first.outputs


def test_a_changed_section_reruns_only_the_tasks_that_read_it(runs):
    _, _, changed = runs
    assert changed.by_task("cache hit") == TASKS[:3]
    assert changed.by_task("ran") == ["tasks.rl.publish"]


def test_a_task_reading_a_path_it_did_not_download_fails(cluster):
    with pytest.raises(PodFailed, match=r"(?s)read_path.*No such file or directory"):
        cluster.run(leaky.leaky)


def test_a_file_returned_as_an_upload_reaches_the_next_pod(store, cluster):
    execution = cluster.run(leaky.uploaded)
    assert execution.outputs.literals["o0"].scalar.primitive.string_value == "42"


def test_a_pod_sees_an_empty_directory_its_own_home_and_the_images_code(cluster):
    with_view = cluster.run(leaky.pod_view, probe=str(REPO / "pyproject.toml"))
    with cluster.store.context() as ctx:
        view = TypeEngine.to_python_value(ctx, with_view.outputs.literals["o0"], dict[str, str])
    assert view["cwd_entries"] == ""
    pod = Path(view["cwd"]).parent
    assert Path(view["home"]).parent == pod and view["tmpdir"] == ("/tmp" if CONFINED else str(pod / "tmp"))  # /tmp: the pod's own
    assert not pod.exists()  # the pod's disk ended with it
    assert Path(view["code"]).is_relative_to(cluster.code)  # the image's copy, not the checkout
    assert view["probe_exists"] == "False"  # the submitter's checkout is not on a pod's disk


def test_a_local_run_root_sends_the_artifacts_under_the_executions_raw_output_prefix(store, cluster, tmp_path):
    """On a cluster a folder as run root would be a pod's own disk: the tasks write under the raw-output prefix instead."""
    execution = cluster.run(convert, cfg=load_recipe("recipes/smoke.yaml", {"run_root": str(tmp_path / "runs"), "publish.dtype": "float16"}))
    policy, exported = downloaded(store, execution.outputs.literals["exported"], Policy, tmp_path / "exported")
    assert policy.dir.remote_source.startswith(store.uri("raw", execution.name))
    assert AutoModelForCausalLM.from_pretrained(exported).config.model_type == "qwen2"
    assert not (tmp_path / "runs").exists()
