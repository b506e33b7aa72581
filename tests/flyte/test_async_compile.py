"""The async phase compiles into a Ray job a KubeRay cluster can run: a head, a rollout and a trainer worker group, cached."""

import pytest

import miles_core
from tasks.async_phase import async_phase
from tasks.tracking import log_phase
from tests.flyte.test_compile import compile_entity

pytestmark = pytest.mark.flyte


def test_async_phase_is_a_cached_ray_job_with_rollout_and_trainer_groups():
    template = compile_entity(async_phase).template
    assert template.type == "ray"
    assert template.metadata.discoverable and template.metadata.discovery_version.startswith(f"{miles_core.__version__}-")
    cluster = template.custom["rayCluster"]
    assert [g["groupName"] for g in cluster["workerGroupSpec"]] == ["rollout", "trainer"]
    assert "headGroupSpec" in cluster
    assert {"ckpt", "policy", "buffer", "state", "steps", "first_iteration"} <= set(template.interface.inputs)


def test_phase_logging_always_runs():
    assert not compile_entity(log_phase).template.metadata.discoverable
