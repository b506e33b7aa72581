"""The RL workflow: base model (admitted) -> SFT -> convert -> [rollout -> score -> (teacher) -> train -> publish] x N.

    pyflyte run workflows/rl.py rl --cfg "$(python -m miles_core.config recipes/tiny_arith_cpu.yaml)"
    pyflyte run workflows/rl.py rl_recipe --recipe s3://bucket/my_recipe.yaml --overrides '["iterations=40"]'

Composition only: every stage is a cached task in tasks/, so a re-run with the same config resumes
after the last completed task, and editing one config section re-runs only what depends on it.
The loop is cut into blocks of at most cluster.block_iterations iterations (`miles_core.loop_plan`), one dynamic
node each, which pass the loop's state (checkpoint, policy, data state, buffer, the newest checkpoints kept, last
evaluation) on: a run of 1,000 iterations is a loop node of 1 + 1000 / block nodes, each block about 5 nodes an
iteration (6 where cluster.keep_checkpoints prunes: workflows/nodes.py `kept`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from flytekit import dynamic, workflow
from flytekit.types.file import FlyteFile

from containers.images import cpu_image
from miles_core.config import RunConfig
from miles_core.data.source import DataState
from miles_core.loop_plan import block_plan, phase_plan, plan_blocks
from miles_core.plugins import STAGE_PLUGPOINTS, plugin_code
from tasks.common import Checkpoint, Dataset, Policy, Tracking
from tasks.metadata import BUILDER
from tasks.prepare import admit_model, base_model, make_data, read_recipe
from tasks.sft import sft
from tasks.tracking import Report, finish_run, log_iteration, log_phase, mark_failed, start_run
from workflows.nodes import Kept, converted, evaluated, iterated, kept, phased, teacher_of


class LoopResult(NamedTuple):
    policy: Policy
    evaluation: dict[str, float]


class LoopState(NamedTuple):
    """What one block of the loop leaves for the next."""

    ckpt: Checkpoint
    policy: Policy
    state: DataState
    buffer: Optional[FlyteFile]  # noqa: UP045 (the Optional flytekit's type engine reads)
    recent: list[Checkpoint]  # the newest cluster.keep_checkpoints checkpoints, ckpt the last ([]: every one is kept)
    recent_policies: list[Policy]  # the policies published from them, policy the last
    evaluation: dict[str, float]  # the last held-out evaluation (the final policy's, after the last block)


def plan(cfg: RunConfig) -> list[tuple[int, int, bool]]:
    return phase_plan(cfg.iterations, cfg.async_phase, cfg.evaluation.interval)


@dynamic(container_image=cpu_image, **BUILDER)
def evaluate_start(cfg: RunConfig, start: Policy, dataset: Dataset) -> dict[str, float]:
    """The held-out evaluation before RL; a dynamic node, since only there the recipe's values (its pod's GPUs) are known."""
    return evaluated(cfg, start, dataset, plugin_code(cfg, "evaluate"))


@dynamic(container_image=cpu_image, **BUILDER)
def rl_block(
    cfg: RunConfig,
    reference: Policy,
    teacher: Optional[Policy],  # noqa: UP045 (the Optional flytekit's type engine reads) the distillation teacher, or None
    dataset: Dataset,
    run: Tracking,
    ckpt: Checkpoint,
    policy: Policy,
    state: DataState,
    buffer: Optional[FlyteFile],  # noqa: UP045 (the Optional flytekit's type engine reads)
    recent: list[Checkpoint],
    recent_policies: list[Policy],
    evaluation: dict[str, float],
    first: int,
    stop: int,
) -> LoopState:
    """Iterations [first, stop), sync or in async phases (async_phase.schedule), from the state the block before left."""
    code = {stage: plugin_code(cfg, stage) for stage in STAGE_PLUGPOINTS}  # the recipe's plug-in sources, per stage
    recent, logged = Kept(recent, recent_policies), {}  # logged: iterations done -> the node that logged their policy
    for it, async_steps, due in block_plan(plan(cfg), first, stop):  # (it, 0, _): one sync iteration
        if async_steps:  # an async phase of K steps on Ray; its buffer and data state feed what follows
            phase = phased(cfg, ckpt, policy, reference, dataset, state, buffer, it, async_steps, code["async"])
            evaluation = evaluated(cfg, phase.policy, dataset, code["evaluate"]) if due else evaluation
            logged[it + async_steps] = log_phase(run=run, first_iteration=it, phase=phase, evaluation=evaluation if due else {})
            ckpt, policy, state, buffer = phase.ckpt, phase.policy, phase.state, phase.buffer
            recent = kept(cfg, recent, ckpt, policy, it + async_steps, logged)
            continue
        step = iterated(cfg, ckpt, policy, reference, teacher, dataset, state, buffer, it, code)
        evaluation = evaluated(cfg, step.policy, dataset, code["evaluate"]) if due else evaluation
        logged[it + 1] = log_iteration(
            run=run,
            iteration=it,
            rollout=step.batch.metrics,
            score=step.scored.metrics,
            train=step.trained.metrics,
            evaluation=evaluation if due else {},
            policy=step.policy,
        )
        ckpt, policy, state, buffer = step.trained.ckpt, step.policy, step.batch.state, step.batch.buffer
        recent = kept(cfg, recent, ckpt, policy, it + 1, logged)
    return ckpt, policy, state, buffer, recent.checkpoints, recent.policies, evaluation


def started(cfg: RunConfig, start: Policy) -> LoopState:
    """The loop's state before its first iteration: the SFT policy, converted to the trainer's format."""
    ckpt = converted(cfg, start)
    recent = kept(cfg, Kept([], []), ckpt, start, 0, {})
    return LoopState(ckpt, start, DataState(), None, recent.checkpoints, recent.policies, evaluation={})


def blocks(cfg: RunConfig, carried: LoopState, start: Policy, dataset: Dataset, run: Tracking, first: int, stop: int) -> LoopState:
    """Iterations [first, stop) of `cfg`'s loop from the state `carried`, block by block (the loop's own blocks, cut at
    first and stop)."""
    teacher = teacher_of(cfg, start) if cfg.distill.teacher else None
    for begin, end in plan_blocks(plan(cfg), cfg.cluster.block_iterations):
        if begin < stop and end > first:
            carried = rl_block(
                cfg=cfg, reference=start, teacher=teacher, dataset=dataset, run=run, **carried._asdict(), first=max(begin, first), stop=min(end, stop)
            )
    return LoopState(*carried)


@dynamic(container_image=cpu_image, **BUILDER)
def rl_loop(cfg: RunConfig, start: Policy, dataset: Dataset, run: Tracking) -> LoopResult:
    """Every iteration, block by block; returns the final policy and its held-out evaluation."""
    carried = blocks(cfg, started(cfg, start), start, dataset, run, 0, cfg.iterations)
    return carried.policy, carried.evaluation


class Prepared(NamedTuple):
    base: Policy
    dataset: Dataset
    start: Policy  # the policy RL starts from (the base after SFT)
    before: dict[str, float]  # its held-out evaluation


def prepared(cfg: RunConfig) -> Prepared:
    """What the loop starts from: the admitted base model, the prompt files, the SFT policy and its evaluation."""
    base = admit_model(base=base_model(cfg=cfg.model, root=cfg.run_root), train=cfg.train, rollout=cfg.rollout)
    dataset = make_data(cfg=cfg.data, root=cfg.run_root)
    start = sft(cfg=cfg.sft, data=cfg.data, base=base, dataset=dataset, root=cfg.run_root)
    return Prepared(base, dataset, start, evaluate_start(cfg=cfg, start=start, dataset=dataset))


@workflow(on_failure=mark_failed)
def rl(cfg: RunConfig = RunConfig()) -> Report:  # noqa: B008 (the workflow's default input, frozen)
    base, dataset, start, before = prepared(cfg)
    run = start_run(cfg=cfg, dataset=dataset, base=base, start=start, evaluation=before)
    final = rl_loop(cfg=cfg, start=start, dataset=dataset, run=run)
    return finish_run(run=run, before=before, after=final.evaluation, policy=final.policy, root=cfg.run_root)


@workflow
def rl_recipe(recipe: FlyteFile, overrides: list[str] = []) -> Report:  # noqa: B006 (the workflow's default input)
    """`rl` on a recipe file (an object-store URI, or a local file pyflyte uploads) with `key=value` overrides, read and
    checked by its own task first (tasks/prepare.py `read_recipe`)."""
    return rl(cfg=read_recipe(recipe=recipe, overrides=overrides))
