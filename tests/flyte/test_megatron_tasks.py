"""The trainer tasks (one set for both backends) and the megatron recipes compile into the Flyte spec:
Elastic pods, cache settings, resources, and the train task's processes taken from the recipe."""

import pytest
from flytekit import workflow
from flytekit.models.task import Resources

import miles_core
from containers.images import cpu_image
from miles_core.config import TrainConfig, load_recipe
from tasks import rl as rl_tasks
from tasks.common import BatchResult, Checkpoint, Policy
from tasks.elastic import elastic_resolver
from tests.conftest import REPO, extends
from tests.flyte.test_compile import SETTINGS, compile_entity
from workflows.nodes import trained_on

pytestmark = pytest.mark.flyte


@pytest.mark.parametrize("task", [rl_tasks.convert, rl_tasks.train, rl_tasks.publish], ids=lambda t: t.name)
def test_trainer_tasks_are_cached_elastic_pods(task):
    template = compile_entity(task).template
    assert template.metadata.discoverable and template.metadata.discovery_version.startswith(f"{miles_core.__version__}-")
    assert template.container.image == cpu_image.image_name()
    assert {r.name: r.value for r in template.container.resources.requests} == {Resources.ResourceName.CPU: "2", Resources.ResourceName.MEMORY: "8Gi"}
    assert template.extended_resources.shared_memory.mount_path == "/dev/shm"  # NCCL's, torch multiprocessing's
    assert task.task_config.nnodes == 1 and task.task_config.start_method == "fork"


@pytest.mark.parametrize("backend, nnodes, nproc", [("megatron", 1, 4), ("megatron", 1, 1), ("torch", 1, 3), ("megatron", 2, 4), ("torch", 3, 2)])
def test_train_processes_come_from_the_recipe(backend, nnodes, nproc):
    elastic = rl_tasks.train_task(TrainConfig(backend=backend, nnodes=nnodes, nproc_per_node=nproc)).task_config
    assert (elastic.nnodes, elastic.nproc_per_node, elastic.start_method) == (nnodes, nproc, "fork")


def test_a_pod_builds_the_train_task_again_with_the_recipe_processes():
    """The task's pod loads it through its resolver from the arguments written at serialization: same name, same sizes."""
    sized = rl_tasks.train_task(TrainConfig(nnodes=4, nproc_per_node=8))
    args = elastic_resolver.loader_args(SETTINGS, sized)
    assert args == ["task-module", "tasks.rl", "task-name", "train", "nnodes", "4", "nproc-per-node", "8"] + [
        *("max-restarts", "0", "rdzv-timeout", "900", "rdzv-join-timeout", "900"),  # the cluster section's defaults
        *("in-process", "0"),
    ]
    loaded = elastic_resolver.load_task(args)
    assert loaded.name == rl_tasks.train.name and (loaded.task_config.nnodes, loaded.task_config.nproc_per_node) == (4, 8)
    assert loaded is sized  # the same variant, restarts and rendezvous included
    assert loaded.metadata.cache_version == rl_tasks.train.metadata.cache_version  # the same cache entries as the task defined in tasks/rl.py


def test_a_one_node_variant_compiles_to_the_pod_of_the_task_defined_in_tasks_rl():
    """A one-node variant rendezvouses where it runs (statically): nothing a cluster reads changes."""
    variant, defined = (compile_entity(t).template for t in (rl_tasks.train_task(TrainConfig()), rl_tasks.train))
    pods = [(t.container.to_flyte_idl(), t.extended_resources) for t in (variant, defined)]
    for container, _ in pods:
        del container.args[:]
    assert pods[0] == pods[1] and (variant.type, variant.custom) == (defined.type, defined.custom)  # the args name the variant's resolver
    assert variant.metadata.discovery_version == defined.metadata.discovery_version
    multi_node = compile_entity(rl_tasks.train_task(TrainConfig(nnodes=2))).template
    assert multi_node.custom["elasticConfig"]["rdzvBackend"] == "c10d"  # a PyTorchJob's nodes still meet through c10d


@pytest.mark.parametrize("recipe", ["recipes/tiny_arith_megatron.yaml", "recipes/qwen3_4b_megatron_gpu.yaml"])
def test_megatron_recipes_validate_and_compile_with_their_resources(recipe):
    cfg = load_recipe(recipe)
    assert cfg.train.backend == "megatron"

    @workflow
    def one_step(ckpt: Checkpoint, batch: BatchResult, reference: Policy):
        trained_on(cfg, ckpt, batch, reference, 0, "")

    overrides = compile_entity(one_step).template.nodes[0].task_node.overrides
    gpus = [r.value for r in overrides.resources.requests if r.name == Resources.ResourceName.GPU] if overrides.resources else []
    assert gpus == ([str(cfg.train.gpus_per_node)] if cfg.train.gpus_per_node else [])
    elastic = rl_tasks.train_task(cfg.train).task_config
    assert (elastic.nnodes, elastic.nproc_per_node) == (cfg.train.nnodes, cfg.train.nproc_per_node)


def test_gpu_recipe_parallel_sizes():
    train = load_recipe("recipes/qwen3_4b_megatron_gpu.yaml").train
    assert (train.tensor_parallel, train.pipeline_parallel, train.nproc_per_node // 2) == (2, 1, 4)  # TP x PP x DP = 8 GPUs


def test_bad_parallel_sizes_fail_before_anything_runs(tmp_path):
    from miles_core.config import ConfigError

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: {extends(REPO / 'recipes/tiny_arith_megatron.yaml', bad)}\ntrain: {{tensor_parallel: 3}}\n")
    with pytest.raises(
        ConfigError, match=r"bad.yaml: train.nproc_per_node: nnodes x nproc_per_node = 2 must be a multiple of tensor_parallel x pipeline_parallel = 3"
    ):
        load_recipe(bad)
