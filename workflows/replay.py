"""A replay (docs/replay.md): a finished or failed run again from iteration N with changed settings.

    pyflyte run workflows/replay.py replay --cfg "$(python -m miles_core.config recipes/tiny_arith_cpu.yaml)" \
        --from_iteration 10 --changes '["algo.eps_clip_high=0.28"]' --rollouts cached

`cfg` is the parent run's config. The iterations before N are the parent's own nodes, cache hits; from N the changed
config (`miles_core.replay.replayed`) regenerates its rollouts (`regenerate`) or trains on the parent's scored batches of
iterations N.. (`cached`), their nodes cache hits too. The replay is an MLflow run of its own, tagged with its parent
run, N and the mode. Composition only.
"""

from __future__ import annotations

from typing import Optional

from flytekit import dynamic, workflow
from flytekit.types.file import FlyteFile

from containers.images import cpu_image
from miles_core.config import RunConfig
from miles_core.data.source import DataState
from miles_core.plugins import STAGE_PLUGPOINTS, plugin_code
from tasks.common import BatchResult, Checkpoint, Dataset, Policy, Tracking
from tasks.metadata import BUILDER
from tasks.replay import replay_config, tag_replay
from tasks.tracking import Report, finish_run, log_iteration, start_run
from workflows.nodes import evaluated, iterated, published, teacher_of, trained_on
from workflows.rl import LoopResult, blocks, plan, prepared, started


@dynamic(container_image=cpu_image, **BUILDER)
def parent_batches(
    parent: RunConfig,
    start: Policy,
    dataset: Dataset,
    ckpt: Checkpoint,
    policy: Policy,
    state: DataState,
    buffer: Optional[FlyteFile],  # noqa: UP045 (the Optional flytekit's type engine reads)
    first: int,
) -> list[BatchResult]:
    """The parent run's scored batches of its iterations from `first` on, from its loop state there (cache hits)."""
    code = {stage: plugin_code(parent, stage) for stage in STAGE_PLUGPOINTS}
    teacher = teacher_of(parent, start) if parent.distill.teacher else None
    batches = []
    for it in range(first, parent.iterations):
        step = iterated(parent, ckpt, policy, start, teacher, dataset, state, buffer, it, code)
        batches.append(step.scored)
        ckpt, policy, state, buffer = step.trained.ckpt, step.policy, step.batch.state, step.batch.buffer
    return batches


@dynamic(container_image=cpu_image, **BUILDER)
def train_on_batches(
    cfg: RunConfig,
    start: Policy,
    dataset: Dataset,
    run: Tracking,
    ckpt: Checkpoint,
    policy: Policy,
    evaluation: dict[str, float],
    batches: list[BatchResult],
    first: int,
) -> LoopResult:
    """cfg's train and publish on each given batch in turn from `ckpt`, iterations first.., evaluated and logged as the
    loop does."""
    code = {stage: plugin_code(cfg, stage) for stage in STAGE_PLUGPOINTS}
    due = {it: flag for it, _, flag in plan(cfg)}
    for it, batch in enumerate(batches, start=first):
        trained = trained_on(cfg, ckpt, batch, start, it, code["train"])
        policy = published(cfg, trained.ckpt, policy)
        evaluation = evaluated(cfg, policy, dataset, code["evaluate"]) if due[it] else evaluation
        log_iteration(run=run, iteration=it, rollout={}, score=batch.metrics, train=trained.metrics, evaluation=evaluation if due[it] else {}, policy=policy)
        ckpt = trained.ckpt
    return policy, evaluation


@dynamic(container_image=cpu_image, **BUILDER)
def replay_loop(parent: RunConfig, cfg: RunConfig, start: Policy, dataset: Dataset, run: Tracking, from_iteration: int, rollouts: str) -> LoopResult:
    """The parent's iterations before from_iteration, then cfg's from there on its own rollouts or the parent's."""
    carried = blocks(parent, started(parent, start), start, dataset, run, 0, from_iteration)
    if rollouts == "cached":
        ckpt, policy, state, buffer, _, _, evaluation = carried
        batches = parent_batches(parent=parent, start=start, dataset=dataset, ckpt=ckpt, policy=policy, state=state, buffer=buffer, first=from_iteration)
        return train_on_batches(
            cfg=cfg, start=start, dataset=dataset, run=run, ckpt=ckpt, policy=policy, evaluation=evaluation, batches=batches, first=from_iteration
        )
    carried = blocks(cfg, carried, start, dataset, run, from_iteration, cfg.iterations)
    return carried.policy, carried.evaluation


@workflow
def replay(cfg: RunConfig, from_iteration: int, changes: list[str], rollouts: str = "regenerate") -> Report:
    """The run of `cfg` replayed from iteration `from_iteration` with `changes` (`key=value`), on rollouts regenerated
    (on-policy) or the parent's cached ones."""
    changed = replay_config(parent=cfg, changes=changes, from_iteration=from_iteration, rollouts=rollouts)
    base, dataset, start, before = prepared(cfg)
    started_run = start_run(cfg=changed, dataset=dataset, base=base, start=start, evaluation=before)
    run = tag_replay(run=started_run, parent=cfg, from_iteration=from_iteration, rollouts=rollouts)
    final = replay_loop(parent=cfg, cfg=changed, start=start, dataset=dataset, run=run, from_iteration=from_iteration, rollouts=rollouts)
    return finish_run(run=run, before=before, after=final.evaluation, policy=final.policy, root=changed.run_root)
