"""The tasks of one RL iteration, for every trainer backend: convert (once), rollout, score, train, publish, evaluate.

Each unpacks its typed inputs, calls miles_core (`step` over the plug-points `bind` resolves, the
trainer `backends` that `train.backend` picks) and returns typed outputs that point at artifacts
under the run root. `code` is the digest of the recipe's plug-in modules the task runs
(`miles_core.plugins.plugin_code`): an input, so a changed plug-in re-runs exactly the tasks that run it.

convert, train and publish run as kfpytorch `Elastic` tasks: their workers are fresh processes
(torchrun semantics, one per GPU on a cluster; locally `start_method="fork"`, gloo on CPU), so a
backend's process groups never live in the workflow's own process. Elastic returns rank 0's
value. One process of the torch backend (world size 1, no process group) runs in the task's own process instead
(tasks/elastic.py `OneProcessTask`). The train task's processes (`train_task`: a variant defined with the recipe's nnodes x nproc_per_node), every
Elastic task's restarts and rendezvous (`tasks.elastic.elastic`), and each node's GPUs, memory, retries and timeout
(`tasks.metadata.stage_overrides`) come from the recipe; the workflow applies them. What each task declares is the
default (tasks/metadata.py); `recoverable` marks network and object-store errors for Flyte's retries (tasks/retry.py).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Optional

import torch
from flytekit import task
from flytekit.types.file import FlyteFile
from flytekitplugins.kfpytorch import Elastic

from containers.images import cpu_image
from miles_core.batch_io import read_batch, write_batch
from miles_core.config import (
    AlgoConfig,
    ClusterConfig,
    DataConfig,
    DebugConfig,
    DistillConfig,
    EvalConfig,
    HealthConfig,
    HooksConfig,
    PublishConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)
from miles_core.data.source import DataState, Prompt, load_prompts
from miles_core.models import vocab_size
from miles_core.models.tokenizers import load_tokenizer
from miles_core.plugins import plugin
from miles_core.rollout.engines import make_engine, weight_update_metrics
from miles_core.step import bind, groups_of, rollout_seed, score_batch, scorer_of
from miles_core.storage import atomic_dir
from miles_core.train.backends import convert_checkpoint, export_policy, preload, train_checkpoint
from tasks.common import (
    BatchResult,
    Checkpoint,
    Dataset,
    Policy,
    RolloutResult,
    TrainResult,
    base_dir_of,
    cache_version,
    fetched,
    new_artifact,
    stored_dir,
    uploaded_dir,
    uploaded_file,
    uri_of,
)
from tasks.debug import train_outputs
from tasks.decks import DECKS, batch_decks, own_decks_only
from tasks.elastic import elastic, resizable_task
from tasks.metadata import DEFAULTS, cached, declared
from tasks.retention import unpruned
from tasks.retry import recoverable

# torch elastic polls its workers this often (seconds; torch's default is 0.1, flytekit's 5): a finished step is noticed
# within it, so it bounds what every Elastic task adds to an iteration's wall time; a poll of a waiting agent costs
# microseconds
MONITOR_S = 0.02


def one_node(nproc_per_node: int) -> dict:
    """The @task arguments of an Elastic task of forked workers on one node, polled every MONITOR_S. The pod's /dev/shm
    (NCCL's and torch multiprocessing's) is the task's `shared_memory`, not the plugin's deprecated pod template."""
    elastic = Elastic(nnodes=1, nproc_per_node=nproc_per_node, start_method="fork", monitor_interval=MONITOR_S, increase_shared_mem=False)
    return {"task_config": elastic, "shared_memory": True}


def train_task(cfg: TrainConfig, cluster: ClusterConfig = DEFAULTS):
    """The train task with the recipe's processes, train.nnodes x train.nproc_per_node (data parallel on either backend;
    megatron also splits tensors, layers and experts), and its restarts and rendezvous timeouts. Locally the workers fork
    from the task's process; on a cluster each node is a pod. One process of the torch backend runs in the task's own."""
    return elastic(train, cluster, cfg.nnodes, cfg.nproc_per_node, in_process=cfg.backend == "torch")


def _forked_worker() -> None:
    """In a worker torch elastic forked (a one-process task of the torch backend runs in its own process instead:
    tasks/elastic.py `OneProcessTask`): it computes on one thread, since it was forked from a process whose OpenMP
    thread team already ran (libgomp is not fork-safe: a new team would deadlock; one process per core here), and the
    decks it returns are its own."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torch's elastic agent in its workers
        torch.set_num_threads(1)
        own_decks_only()


def _prompts(dataset_file, data: DataConfig) -> list[Prompt]:
    """The prompts of a dataset file, read and checked once per process and file: a process that runs the task again on
    the same file (a local run: every iteration's rollout) keeps the ~4,000 prompts instead of parsing them each time."""
    path = dataset_file.download()
    stat = os.stat(path)
    return list(_read_prompts(path, stat.st_size, stat.st_mtime_ns, (data.input_key, data.label_key, data.metadata_key)))


@functools.lru_cache(maxsize=4)
def _read_prompts(path: str, size: int, mtime_ns: int, keys: tuple[str, str, str]) -> tuple[Prompt, ...]:
    return tuple(load_prompts(path, *keys))  # size and mtime_ns: a file changed in place is read again


@resizable_task(
    lambda cfg, **_: preload(cfg),
    **cached(cache_version(TrainConfig, AlgoConfig, module=__name__)),
    container_image=cpu_image,
    **one_node(1),
    **declared("convert"),
)
@recoverable
def convert(cfg: TrainConfig, algo: AlgoConfig, policy: Policy, root: str) -> Checkpoint:
    """Base HF checkpoint -> the backend's checkpoint format (megatron: torch_dist, reshardable), and a fresh critic for PPO."""
    _forked_worker()
    out, dest = new_artifact(root, "checkpoint", 0, cfg, algo, uri_of(policy.dir))
    with atomic_dir(out) as tmp:
        convert_checkpoint(cfg, algo, policy.dir.download(), tmp)
    return Checkpoint(dir=uploaded_dir(out, dest), step=0)


@task(**cached(cache_version(RolloutConfig, DataConfig, RewardConfig, module=__name__)), container_image=cpu_image, **declared("rollout"))
@recoverable
def rollout(
    cfg: RolloutConfig,
    data: DataConfig,
    reward: RewardConfig,
    policy: Policy,
    dataset: Dataset,
    state: DataState,
    buffer: Optional[FlyteFile],
    iteration: int,
    root: str,
    code: str,
) -> RolloutResult:  # noqa: UP045 (the Optional flytekit's type engine reads)
    started, fns = time.perf_counter(), bind(rollout=cfg, reward=reward)
    source = plugin(data, "data", "source_fn")(_prompts(dataset.train, data), data.seed, state)
    policy_dir = unpruned(policy.dir).download()
    tokenizer = load_tokenizer(policy_dir)
    shape = {"vocab_size": vocab_size(policy_dir), "group_size": cfg.n_samples}
    waiting = groups_of(read_batch(buffer.download(), scored=True, **shape), cfg.n_samples) if buffer is not None else []
    engine = make_engine(cfg, policy_dir, policy.version, base_dir_of(policy), shared=True)
    samples, left, metrics = fns.rollout_fn(engine, source, tokenizer, fns, scorer_of(fns, tokenizer), waiting, rollout_seed(cfg, iteration))
    metrics.update(weight_update_metrics(engine))
    inputs = (cfg, reward, uri_of(policy.dir), state, uri_of(buffer) if buffer else "", code)
    out, dest = new_artifact(root, "rollout", iteration, *inputs, suffix=".parquet")
    left_out, left_dest = new_artifact(root, "rollout", iteration, *inputs, suffix=".buffer.parquet")
    write_batch(samples, out, **shape)
    left_file = uploaded_file(write_batch([s for g in left for s in g], left_out, scored=True, **shape), left_dest) if left else None
    metrics["time/rollout_task_s"] = time.perf_counter() - started  # the task's whole body: its I/O beside time/rollout_s
    return RolloutResult(batch=uploaded_file(out, dest), state=source.state, metrics=metrics, buffer=left_file)


@task(**cached(cache_version(RewardConfig, HooksConfig, RolloutConfig, module=__name__)), container_image=cpu_image, **DECKS, **declared("score"))
@recoverable
def score(
    cfg: RewardConfig, hooks: HooksConfig, rollout: RolloutConfig, policy: Policy, batch: RolloutResult, iteration: int, root: str, code: str
) -> BatchResult:
    started, policy_dir = time.perf_counter(), policy.dir.download()
    shape = {"vocab_size": vocab_size(policy_dir), "group_size": rollout.n_samples}
    samples, tokenizer = read_batch(batch.batch.download(), **shape), load_tokenizer(policy_dir)
    metrics = score_batch(samples, bind(rollout=rollout, reward=cfg, hooks=hooks), tokenizer, iteration, batch.metrics)
    out, dest = new_artifact(root, "scored", iteration, cfg, hooks, uri_of(batch.batch), code, suffix=".parquet")
    write_batch(samples, out, scored=True, reward_range=(cfg.min, cfg.max), **shape)
    batch_decks(samples, tokenizer, metrics)  # the batch in the Flyte console: responses, histograms
    metrics["time/score_task_s"] = time.perf_counter() - started
    return BatchResult(batch=uploaded_file(out, dest), metrics=metrics)


@resizable_task(
    lambda cfg, **_: preload(cfg),
    **cached(cache_version(AlgoConfig, TrainConfig, RolloutConfig, HooksConfig, HealthConfig, DebugConfig, DistillConfig, module=__name__)),
    container_image=cpu_image,
    **DECKS,
    **one_node(TrainConfig().nproc_per_node),  # a run's: train_task(cfg)
    **declared("train"),
)
@recoverable
def train(
    algo: AlgoConfig,
    cfg: TrainConfig,
    reward: RewardConfig,
    rollout: RolloutConfig,
    hooks: HooksConfig,
    health: HealthConfig,
    debug: DebugConfig,
    distill: DistillConfig,
    ckpt: Checkpoint,
    batch: BatchResult,
    reference: Policy,
    iteration: int,
    root: str,
    code: str,
) -> TrainResult:
    """One RL step on every process (each trains its data-parallel rows); rank 0's result is the task's."""
    started = time.perf_counter()
    _forked_worker()
    reference_dir = fetched(uri_of(reference.dir))  # each process its own copy (tasks/common.py fetched)
    samples = read_batch(
        fetched(uri_of(batch.batch), directory=False),
        scored=True,
        reward_range=(reward.min, reward.max),
        vocab_size=vocab_size(reference_dir),
        group_size=rollout.n_samples,
        distilled=bool(distill.teacher),  # the teacher's task scored it (tasks/distill.py)
    )
    inputs = (algo, cfg, rollout, hooks, health, distill, uri_of(ckpt.dir), uri_of(batch.batch), code)
    out, dest = new_artifact(root, "checkpoint", iteration + 1, *inputs)
    fns, trace = bind(rollout=rollout, reward=reward, algo=algo, hooks=hooks, health=health, distill=distill), {}
    step, metrics = train_checkpoint(cfg, fns, fetched(uri_of(unpruned(ckpt.dir))), samples, reference_dir, out, iteration, trace)
    dump = train_outputs(samples, reference_dir, trace, metrics, (root, iteration, *inputs) if debug.dump_rollouts else None)
    metrics["time/train_task_s"] = time.perf_counter() - started
    return TrainResult(ckpt=Checkpoint(dir=uploaded_dir(out, dest), step=step), metrics=metrics, dump=dump)


@resizable_task(
    lambda train_cfg, **_: preload(train_cfg),
    **cached(cache_version(PublishConfig, TrainConfig, module=__name__)),
    container_image=cpu_image,
    **one_node(1),
    **declared("publish"),
)
@recoverable
def publish(cfg: PublishConfig, train_cfg: TrainConfig, ckpt: Checkpoint, parent: Policy, root: str) -> Policy:
    """Export the checkpoint (any parallel sizes) as the next policy version (HF safetensors + lineage manifest); with
    train.lora the adapter alone, for the base model its parent applies to: the first adapter's parent is the full
    policy the checkpoint was converted from, each later one's an adapter on that same base."""
    _forked_worker()
    version = parent.version + 1
    out, dest = new_artifact(root, "policy", version, cfg, uri_of(ckpt.dir))
    base = (parent.base or parent.dir) if train_cfg.lora.rank else None
    base_dir = base.download() if base is not None else None
    export_policy(train_cfg, ckpt.dir.download(), out, cfg, version, parent.version, source=uri_of(ckpt.dir), base_dir=base_dir)
    base = stored_dir(uri_of(base)) if base is not None else None  # passed on as it is stored, not uploaded again
    return Policy(dir=uploaded_dir(out, dest), version=version, base=base)


@task(**cached(cache_version(EvalConfig, RewardConfig, DataConfig, RolloutConfig, module=__name__)), container_image=cpu_image, **declared("evaluate"))
@recoverable
def evaluate(cfg: EvalConfig, reward: RewardConfig, data: DataConfig, rollout: RolloutConfig, policy: Policy, dataset: Dataset, code: str) -> dict[str, float]:
    """Held-out evaluation of a policy version (evaluation.fn, greedy accuracy by default), with the task's own time
    (`time/evaluate_s`: what a benchmark of training time leaves out)."""
    started = time.perf_counter()
    policy_dir = unpruned(policy.dir).download()
    engine = make_engine(rollout, policy_dir, policy.version, base_dir_of(policy), shared=True, max_batch_sequences=cfg.batch_size)
    fns = bind(rollout=rollout, reward=reward, evaluation=cfg)
    metrics = fns.evaluate_fn(engine, _prompts(dataset.test, data), load_tokenizer(policy_dir), fns)
    print(f"evaluate: policy v{policy.version}: held-out accuracy {metrics['eval/accuracy']:.3f}")
    return {**metrics, "time/evaluate_s": time.perf_counter() - started}
