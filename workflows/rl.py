"""The RL workflow: base model (admitted) -> SFT -> convert -> [rollout -> score -> train -> publish] x N.

    pyflyte run workflows/rl.py rl --cfg "$(python -m miles_core.config recipes/tiny_arith_cpu.yaml)"

Composition only: every stage is a cached task in tasks/, so a re-run with the same config resumes
after the last completed task, and editing one config section re-runs only what depends on it.
"""

from __future__ import annotations

from typing import NamedTuple

from flytekit import dynamic, workflow

from containers.images import cpu_image
from miles_core.async_loop import phase_plan
from miles_core.config import RunConfig
from miles_core.data.source import DataState
from miles_core.plugins import STAGE_PLUGPOINTS, plugin_code
from tasks.async_phase import async_phase
from tasks.common import Dataset, Policy, Tracking
from tasks.prepare import admit_model, base_model, make_data
from tasks.rl import convert, evaluate, publish, rollout, rollout_overrides, score, train_overrides, train_task
from tasks.sft import sft
from tasks.tracking import Report, finish_run, log_iteration, log_phase, start_run


class LoopResult(NamedTuple):
    policy: Policy
    evaluation: dict[str, float]


# The nodes whose pods the recipe sizes, written once for the loop (and the tests that compile what it builds).


def rolled_out(cfg: RunConfig, policy: Policy, dataset: Dataset, state: DataState, buffer, iteration: int, code: str):
    """The rollout task of one iteration, its pod sized by the recipe (the GPUs of the SGLang servers it launches)."""
    node = rollout(
        cfg=cfg.rollout,
        data=cfg.data,
        reward=cfg.reward,
        policy=policy,
        dataset=dataset,
        state=state,
        buffer=buffer,
        iteration=iteration,
        root=cfg.run_root,
        code=code,
    )
    return node.with_overrides(**rollout_overrides(cfg.rollout))


def trained_on(cfg: RunConfig, ckpt, batch, reference: Policy, iteration: int, code: str):
    """The train task of one iteration on a scored batch: the recipe's processes (nnodes x nproc_per_node), GPUs and memory."""
    node = train_task(cfg.train)(
        algo=cfg.algo,
        cfg=cfg.train,
        reward=cfg.reward,
        rollout=cfg.rollout,
        hooks=cfg.hooks,
        ckpt=ckpt,
        batch=batch,
        reference=reference,
        iteration=iteration,
        root=cfg.run_root,
        code=code,
    )
    return node.with_overrides(**train_overrides(cfg.train))


def evaluated(cfg: RunConfig, policy: Policy, dataset: Dataset, code: str):
    """The evaluate task on `policy`, its pod sized like the rollout's (the GPUs of the SGLang servers it launches)."""
    node = evaluate(cfg=cfg.evaluation, reward=cfg.reward, data=cfg.data, rollout=cfg.rollout, policy=policy, dataset=dataset, code=code)
    return node.with_overrides(**rollout_overrides(cfg.rollout))


@dynamic(container_image=cpu_image)
def evaluate_start(cfg: RunConfig, start: Policy, dataset: Dataset) -> dict[str, float]:
    """The held-out evaluation before RL; a dynamic node, since only there the recipe's values (its pod's GPUs) are known."""
    return evaluated(cfg, start, dataset, plugin_code(cfg, "evaluate"))


@dynamic(container_image=cpu_image)
def rl_loop(cfg: RunConfig, start: Policy, dataset: Dataset, run: Tracking) -> LoopResult:
    """N iterations, sync or in async phases (async_phase.schedule); returns the final policy and its held-out evaluation."""
    root, policy, state, buffer = cfg.run_root, start, DataState(), None
    code = {stage: plugin_code(cfg, stage) for stage in STAGE_PLUGPOINTS}  # the recipe's plug-in sources, per stage
    ckpt = convert(cfg=cfg.train, algo=cfg.algo, policy=start, root=root)
    evaluation = {}
    for it, async_steps, due in phase_plan(cfg.iterations, cfg.async_phase, cfg.evaluation.interval):  # (it, 0, _): one sync iteration
        if async_steps:  # an async phase of K steps on Ray; its buffer and data state feed what follows
            phase = async_phase(
                cfg=cfg.async_phase,
                rollout=cfg.rollout,
                data=cfg.data,
                reward=cfg.reward,
                algo=cfg.algo,
                train=cfg.train,
                hooks=cfg.hooks,
                publish_cfg=cfg.publish,
                ckpt=ckpt,
                policy=policy,
                reference=start,
                dataset=dataset,
                state=state,
                buffer=buffer,
                first_iteration=it,
                steps=async_steps,
                root=root,
                code=code["async"],
            )
            evaluation = evaluated(cfg, phase.policy, dataset, code["evaluate"]) if due else {}
            log_phase(run=run, first_iteration=it, phase=phase, evaluation=evaluation)
            ckpt, policy, state, buffer = phase.ckpt, phase.policy, phase.state, phase.buffer
            continue
        batch = rolled_out(cfg, policy, dataset, state, buffer, it, code["rollout"])
        scored = score(cfg=cfg.reward, hooks=cfg.hooks, rollout=cfg.rollout, policy=policy, batch=batch, iteration=it, root=root, code=code["score"])
        trained = trained_on(cfg, ckpt, scored, start, it, code["train"])
        policy = publish(cfg=cfg.publish, train_cfg=cfg.train, ckpt=trained.ckpt, parent=policy, root=root)
        evaluation = evaluated(cfg, policy, dataset, code["evaluate"]) if due else {}
        log_iteration(run=run, iteration=it, rollout=batch.metrics, score=scored.metrics, train=trained.metrics, evaluation=evaluation, policy=policy)
        ckpt, state, buffer = trained.ckpt, batch.state, batch.buffer
    return policy, evaluation


@workflow
def rl(cfg: RunConfig = RunConfig()) -> Report:  # noqa: B008 (the workflow's default input, frozen)
    base = admit_model(base=base_model(cfg=cfg.model, root=cfg.run_root), train=cfg.train)
    dataset = make_data(cfg=cfg.data, root=cfg.run_root)
    start = sft(cfg=cfg.sft, data=cfg.data, base=base, dataset=dataset, root=cfg.run_root)
    before = evaluate_start(cfg=cfg, start=start, dataset=dataset)
    run = start_run(cfg=cfg, dataset=dataset, base=base, start=start, evaluation=before)
    final = rl_loop(cfg=cfg, start=start, dataset=dataset, run=run)
    return finish_run(run=run, before=before, after=final.evaluation, policy=final.policy, root=cfg.run_root)
