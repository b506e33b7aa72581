"""The real-size recipes, one per frontier model (recipes/*.yaml naming a checkpoint by model.path): each validates,
compiles into a Flyte spec whose train, rollout and evaluate nodes ask for the recipe's processes, GPUs and memory,
has parallel sizes that multiply out to its GPUs and divide its model's published shape, and has a tiny twin.

A recipe that names its checkpoint cannot have the shape checked when it loads (the model section's sizes are unused):
the run checks it when it reads config.json (`miles_core.models.source.admit`), with the function called here on the
config.json each model card publishes (published_configs.py). Running the twins is the slower tier, test_twins.py.
"""

from collections import OrderedDict
from pathlib import Path

import pytest
from flytekit import workflow
from flytekit.models.task import Resources
from flytekit.tools.translator import get_serializable

from containers.images import sglang_image, train_image
from miles_core.checkpoint.hf_megatron import ARCHS
from miles_core.config import ConfigError, load_recipe
from miles_core.config.rules import check_parallel_fit
from miles_core.data.source import DataState
from miles_core.models.source import model_shape
from tasks.common import BatchResult, Checkpoint, Dataset, Policy
from tests.conftest import REPO
from tests.flyte.published_configs import PUBLISHED
from tests.flyte.test_compile import SETTINGS
from workflows.nodes import evaluated, rolled_out, trained_on

pytestmark = pytest.mark.flyte

REAL_SIZE = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml") if load_recipe(p).model.path)


def recipe(name: str):
    return load_recipe(REPO / "recipes" / f"{name}.yaml")


def test_every_real_size_recipe_has_its_published_shape_and_a_twin():
    assert len(REAL_SIZE) >= 13 and set(REAL_SIZE) == set(PUBLISHED)
    assert {p.stem for p in (REPO / "recipes" / "tiny").glob("*.yaml")} == set(REAL_SIZE)


@pytest.mark.parametrize("name", REAL_SIZE)
def test_recipe_trains_a_named_checkpoint_on_gpus(name):
    cfg = recipe(name)
    assert cfg.model.path.startswith("s3://models/")  # the placeholder bucket each recipe tells the user to replace
    assert (cfg.train.backend, cfg.train.dtype, cfg.publish.dtype) == ("megatron", "bfloat16", "bfloat16")
    assert (cfg.rollout.engine, cfg.rollout.sglang.device, cfg.rollout.sglang.dtype) == ("sglang", "cuda", "bfloat16")
    assert cfg.data.train_file and cfg.sft.steps == 0 and cfg.rollout.max_new_tokens >= 4096


@pytest.mark.parametrize("name", REAL_SIZE)
def test_parallel_sizes_multiply_out_to_the_gpus(name):
    train, rollout = recipe(name).train, recipe(name).rollout
    gpus = train.nnodes * train.gpus_per_node
    data_parallel = gpus // (train.tensor_parallel * train.pipeline_parallel)
    assert train.gpus_per_node == train.nproc_per_node == 8  # one process per GPU on nodes of 8
    assert train.tensor_parallel * train.pipeline_parallel * data_parallel == gpus
    assert (train.tensor_parallel * data_parallel) % train.expert_parallel == 0  # experts split over a stage's ranks
    assert rollout.gpus() == rollout.sglang.num_servers * rollout.sglang.tensor_parallel <= train.gpus_per_node  # one node's servers


@pytest.mark.parametrize("name", REAL_SIZE)
def test_parallel_sizes_divide_the_published_shape(name):
    source, config = PUBLISHED[name]
    shape = model_shape(config)
    assert shape["num_layers"] and shape["num_heads"]  # the table holds what the check reads
    check_parallel_fit(recipe(name).train, shape, where=f"{source}: ")  # what admission runs on the downloaded config.json


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("deepseek_v4_flash", {"tensor_parallel": 8}, "train.tensor_parallel: must divide .*DeepSeek-V4-Flash.*: num_kv_heads \\(1\\)"),
        ("deepseek_v3", {"pipeline_parallel": 4, "expert_parallel": 32}, "train.pipeline_parallel: must divide .*DeepSeek-V3.1.*: num_layers \\(61\\)"),
        ("qwen3_5_397b_a17b", {"tensor_parallel": 4}, "train.tensor_parallel: must divide .*Qwen3.5-397B-A17B.*: num_kv_heads \\(2\\)"),
    ],
)
def test_the_published_shape_refuses_a_layout_that_does_not_divide_it(name, overrides, message):
    """Miles' own layouts for these (TP8 for V4-Flash, PP4 with a short last stage for V3) do not divide the shape."""
    cfg = load_recipe(REPO / "recipes" / f"{name}.yaml", {f"train.{k}": v for k, v in overrides.items()})
    source, config = PUBLISHED[name]
    with pytest.raises(ConfigError, match=message):
        check_parallel_fit(cfg.train, model_shape(config), where=f"{source}: ")


def compiled(cfg):
    """One iteration's rollout, train and evaluate nodes as the loop builds them, compiled: {task name: (node, task template)}."""

    @workflow
    def one_iteration(policy: Policy, dataset: Dataset, state: DataState, ckpt: Checkpoint, batch: BatchResult):
        rolled_out(cfg, policy, dataset, state, None, 0, "")
        trained_on(cfg, ckpt, batch, policy, 0, "")
        evaluated(cfg, policy, dataset, "")

    entities = OrderedDict()
    spec = get_serializable(entities, SETTINGS, one_iteration)
    templates = {e.template.id.name: e.template for e in entities.values() if hasattr(getattr(e, "template", None), "custom")}  # the tasks
    return {n.task_node.reference_id.name: (n, templates[n.task_node.reference_id.name]) for n in spec.template.nodes}


RESOURCE_NAMES = {getattr(Resources.ResourceName, n): n for n in ("CPU", "GPU", "MEMORY")}


def requests(node) -> dict:
    resources = node.task_node.overrides.resources
    return {RESOURCE_NAMES[r.name]: r.value for r in resources.requests} if resources else {}


@pytest.mark.parametrize("name", REAL_SIZE)
def test_compiled_nodes_ask_for_the_recipe_processes_gpus_and_memory(name):
    cfg = recipe(name)
    nodes = compiled(cfg)
    train_node, train_template = nodes["tasks.rl.train"]
    nnodes = cfg.train.nnodes
    if nnodes > 1:  # a PyTorchJob of nnodes worker pods, each starting nproc_per_node processes
        elastic = train_template.custom["elasticConfig"]
        assert train_template.type == "pytorch"
        assert (elastic["minReplicas"], elastic["maxReplicas"], elastic["nprocPerNode"]) == (nnodes, nnodes, 8)
    else:  # flytekit runs a one-node Elastic task in a plain pod
        assert train_template.type == "python-task"
    args = train_template.container.args  # the pod builds the task again with the same sizes
    assert (args[args.index("nnodes") + 1], args[args.index("nproc-per-node") + 1]) == (str(nnodes), "8")
    node_gpus = cfg.train.gpus_per_node
    assert requests(train_node) == {"CPU": str(8 * node_gpus), "MEMORY": f"{64 * node_gpus}Gi", "GPU": str(node_gpus)}
    for task in ("tasks.rl.rollout", "tasks.rl.evaluate"):  # both launch the recipe's SGLang servers
        node, _ = nodes[task]
        gpus = cfg.rollout.gpus()
        assert requests(node) == {"CPU": str(8 * gpus), "MEMORY": f"{64 * gpus}Gi", "GPU": str(gpus)}, task


def test_the_compiled_nodes_name_their_images():
    nodes = compiled(recipe("gpt_oss_20b"))
    overrides = {task: node.task_node.overrides.container_image for task, (node, _) in nodes.items()}
    sglang, train = sglang_image.image_name(), train_image.image_name()
    assert overrides == {"tasks.rl.rollout": sglang, "tasks.rl.train": train, "tasks.rl.evaluate": sglang}


def test_a_named_memory_replaces_the_per_gpu_default():
    cfg = load_recipe(REPO / "recipes" / "gpt_oss_20b.yaml", {"train.memory_gb": 1024, "rollout.memory_gb": 96})
    nodes = compiled(cfg)
    assert requests(nodes["tasks.rl.train"][0])["MEMORY"] == "1024Gi"
    assert requests(nodes["tasks.rl.rollout"][0])["MEMORY"] == "96Gi"


def test_a_cpu_recipe_keeps_the_tasks_own_resources():
    nodes = compiled(load_recipe(REPO / "recipes" / "tiny" / "qwen3_4b_megatron_gpu.yaml"))
    assert requests(nodes["tasks.rl.rollout"][0]) == {} and requests(nodes["tasks.rl.train"][0]) == {}
    assert nodes["tasks.rl.train"][1].type == "python-task"  # one node: a plain pod running both processes


@pytest.mark.parametrize("name", REAL_SIZE)
def test_the_twin_is_the_recipe_scaled_down_to_two_cpu_processes(name):
    real, twin = recipe(name), load_recipe(REPO / "recipes" / "tiny" / f"{name}.yaml")
    assert twin.algo == real.algo and twin.train.lr == real.train.lr
    # the recipe's megatron backend in its precision, or torch for exactly the families the megatron converter does not take yet
    megatron = twin.model.arch in ARCHS
    assert (twin.train.backend, twin.train.dtype) == ((real.train.backend, real.train.dtype) if megatron else ("torch", "float32"))
    assert twin.model.path == "" and twin.train.gpus_per_node == 0 and twin.rollout.gpus() == 0
    assert twin.train.nnodes * twin.train.nproc_per_node == 2
    scaled = [(getattr(twin.train, k), getattr(real.train, k)) for k in ("tensor_parallel", "pipeline_parallel", "expert_parallel")]
    assert all(t == 1 or r > 1 for t, r in scaled)  # only a dimension the recipe splits is split in its twin
    assert Path(REPO / "recipes" / "tiny" / f"{name}.yaml").read_text().startswith(f"# Tiny twin of recipes/{name}.yaml")
