"""The workflow and every task compile into a Flyte spec: names, cache settings, typed interfaces, image.

Local execution ignores what only a cluster uses; the compiled spec is where it shows.
"""

from collections import OrderedDict

import pytest
from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.tools.translator import get_serializable

import miles_core
from containers.images import cpu_image
from tasks import distill, prepare, sft, tracking
from tasks import rl as rl_tasks
from workflows.rl import rl, rl_loop

pytestmark = pytest.mark.flyte

SETTINGS = SerializationSettings(
    image_config=ImageConfig(default_image=Image(name="default", fqn="ghcr.io/miles-flyte/default", tag="v0")),
    project="miles",
    domain="development",
    version="v0",
)
CACHED = [
    prepare.base_model,
    prepare.admit_model,
    prepare.make_data,
    sft.sft,
    rl_tasks.convert,
    rl_tasks.rollout,
    rl_tasks.score,
    rl_tasks.train,
    rl_tasks.publish,
    rl_tasks.evaluate,
    distill.teacher_model,
    distill.teach,
]
UNCACHED = [prepare.read_recipe, tracking.start_run, tracking.log_iteration, tracking.finish_run]  # read_recipe: a file changed in place is read again


def compile_entity(entity):
    return get_serializable(OrderedDict(), SETTINGS, entity)


@pytest.mark.parametrize("task", CACHED, ids=lambda t: t.name)
def test_stage_tasks_are_cached_with_a_config_derived_version(task):
    template = compile_entity(task).template
    assert template.metadata.discoverable
    assert template.metadata.discovery_version.startswith(f"{miles_core.__version__}-")
    assert template.container.image == cpu_image.image_name()


def test_cache_versions_differ_by_the_sections_read():
    versions = {t.name: compile_entity(t).template.metadata.discovery_version for t in CACHED}
    assert len(set(versions.values())) > len(CACHED) // 2
    assert versions["tasks.rl.rollout"] != versions["tasks.rl.train"]


@pytest.mark.parametrize("task", UNCACHED, ids=lambda t: t.name)
def test_tracking_tasks_and_the_recipe_reader_always_run(task):
    assert not compile_entity(task).template.metadata.discoverable


def test_typed_interfaces():
    rollout = compile_entity(rl_tasks.rollout).template.interface
    assert set(rollout.inputs) == {"cfg", "data", "reward", "policy", "dataset", "state", "buffer", "iteration", "root", "code"}
    assert set(rollout.outputs) == {"o0"}
    train = compile_entity(rl_tasks.train).template.interface
    assert {"ckpt", "batch", "algo", "cfg", "rollout", "hooks", "reference", "code"} <= set(train.inputs)


def test_workflow_compiles_with_its_static_nodes():
    spec = compile_entity(rl)
    names = [node.id for node in spec.template.nodes]
    assert len(names) == 8  # base_model, admit_model, make_data, sft, evaluate_start, start_run, rl_loop, finish_run
    assert set(spec.template.interface.inputs) == {"cfg"}
    loop = compile_entity(rl_loop).template
    assert set(loop.interface.inputs) == {"cfg", "start", "dataset", "run"}
    assert set(loop.interface.outputs) == {"policy", "evaluation"}
