"""The async phase compiles into a Ray job a KubeRay cluster can run: a head, a rollout and a trainer worker group sized
by the recipe, each pod declaring its group's Ray resource, cached."""

import json

import pytest

import miles_core
from miles_core.async_loop import ROLLOUT_GROUP, TRAINER_GROUP
from miles_core.config.recipe import load_recipe
from tasks.async_phase import async_phase
from tasks.tracking import log_phase
from tests.conftest import REPO
from tests.flyte.futures import block_futures, nodes_by_task, template_of
from tests.flyte.test_compile import compile_entity

pytestmark = pytest.mark.flyte


def groups(template) -> dict[str, dict]:
    return {g["groupName"]: g for g in template.custom["rayCluster"]["workerGroupSpec"]}


def pod_resources(group: dict) -> dict:
    (container,) = group["k8sPod"]["podSpec"]["containers"]
    assert container["resources"]["requests"] == container["resources"]["limits"]
    return container["resources"]["requests"]


def declared_ray_resources(group: dict) -> dict:
    """rayStartParams' resources, a JSON object written as a quoted string (KubeRay's format)."""
    text = group["rayStartParams"]["resources"]
    assert text.startswith('"') and text.endswith('"')
    return json.loads(text[1:-1].replace('\\"', '"'))


def test_async_phase_is_a_cached_ray_job_with_rollout_and_trainer_groups():
    template = compile_entity(async_phase).template
    assert template.type == "ray"
    assert template.metadata.discoverable and template.metadata.discovery_version.startswith(f"{miles_core.__version__}-")
    assert "headGroupSpec" in template.custom["rayCluster"]
    rollout, trainer = groups(template).values()
    assert (rollout["groupName"], rollout["replicas"], trainer["groupName"], trainer["replicas"]) == ("rollout", 2, "trainer", 1)  # the defaults
    assert {"ckpt", "policy", "buffer", "state", "steps", "first_iteration"} <= set(template.interface.inputs)


def test_a_gpu_recipes_phase_sizes_its_groups_and_pins_each_actor_to_its_group():
    """gpt-oss-20b in async phases with three rollout actors: each actor's pod holds the GPUs of the SGLang server its
    engine launches (TP 8); the trainer's pod one GPU (the phase trains in one process); the node runs the SGLang image."""
    overrides = {"async_phase.schedule": "async", "async_phase.rollout_workers": 3, "iterations": 4, "algo.is_correction": "tis"}
    cfg = load_recipe(REPO / "recipes" / "gpt_oss_20b.yaml", overrides)
    spec = block_futures(cfg, 0, 4)
    node, *_ = nodes_by_task(spec)["tasks.async_phase.async_phase"]
    by_name = groups(template_of(spec, node))
    assert by_name["rollout"]["replicas"] == 3 and by_name["trainer"]["replicas"] == 1
    assert pod_resources(by_name["rollout"])["nvidia.com/gpu"] == str(cfg.rollout.gpus()) == "8"
    assert pod_resources(by_name["trainer"])["nvidia.com/gpu"] == "1"
    assert declared_ray_resources(by_name["rollout"]) == {ROLLOUT_GROUP: 1} and declared_ray_resources(by_name["trainer"]) == {TRAINER_GROUP: 1}
    assert "-sglang:" in node.task_node.overrides.container_image


def test_phase_logging_always_runs():
    assert not compile_entity(log_phase).template.metadata.discoverable
