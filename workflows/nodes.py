"""The loop's nodes, each as the recipe sizes and bounds it: processes, GPUs and their type, memory, retries,
timeout, interruptible (tasks/metadata.py `stage_overrides`). Written once for the loop and for the tests that
compile what it builds. Composition only."""

from __future__ import annotations

from typing import Any, NamedTuple

from flytekit.core.promise import Promise

from miles_core.config import RunConfig
from miles_core.data.source import DataState
from miles_core.loop_plan import checkpoints_written, phase_plan, retired
from tasks.async_phase import on_ray
from tasks.common import Dataset, Policy
from tasks.distill import teach, teacher_model
from tasks.elastic import elastic
from tasks.metadata import stage_overrides
from tasks.retention import prune_iteration
from tasks.rl import convert, evaluate, publish, rollout, score, train_task


class Kept(NamedTuple):
    """The newest checkpoints a run keeps (cluster.keep_checkpoints), oldest first, and the policies published from them."""

    checkpoints: list
    policies: list


class Iteration(NamedTuple):
    """The nodes of one sync iteration: what each later one, the tracking and a replay read."""

    batch: Any  # the rollout's RolloutResult (its batch, data state, buffer and metrics)
    scored: Any  # the scored batch the train task trained on (BatchResult)
    trained: Any  # TrainResult: the next checkpoint and the step's metrics
    policy: Any  # the policy published from it


def iterated(cfg: RunConfig, ckpt, policy: Policy, reference: Policy, teacher, dataset: Dataset, state, buffer, iteration: int, code: dict) -> Iteration:
    """One sync iteration: rollout -> score -> (the distillation teacher) -> train -> publish; `code`: the recipe's plug-in
    sources per stage."""
    batch = rolled_out(cfg, policy, dataset, state, buffer, iteration, code["rollout"])
    rewarded = scored(cfg, policy, batch, iteration, code["score"])
    rewarded = taught(cfg, teacher, rewarded, iteration) if teacher is not None else rewarded  # on-policy distillation
    trained = trained_on(cfg, ckpt, rewarded, reference, iteration, code["train"])
    return Iteration(batch, rewarded, trained, published(cfg, trained.ckpt, policy))


def converted(cfg: RunConfig, start: Policy):
    """The base policy in the trainer backend's format, once before the first iteration."""
    node = elastic(convert, cfg.cluster, in_process=cfg.train.backend == "torch")(cfg=cfg.train, algo=cfg.algo, policy=start, root=cfg.run_root)
    return node.with_overrides(**stage_overrides(cfg, "convert"))


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
    return node.with_overrides(**stage_overrides(cfg, "rollout"))


def scored(cfg: RunConfig, policy: Policy, batch, iteration: int, code: str):
    """The score task of one iteration: CPU only (rewards, verifiers, sandboxed tools)."""
    node = score(cfg=cfg.reward, hooks=cfg.hooks, rollout=cfg.rollout, policy=policy, batch=batch, iteration=iteration, root=cfg.run_root, code=code)
    return node.with_overrides(**stage_overrides(cfg, "score"))


def teacher_of(cfg: RunConfig, start: Policy):
    """The distillation teacher's checkpoint (distill.teacher), fetched and admitted against the policy's tokenizer once a run."""
    return teacher_model(path=cfg.distill.teacher, policy=start, root=cfg.run_root)


def taught(cfg: RunConfig, teacher: Policy, batch, iteration: int):
    """The teacher's log-probs of a scored batch's tokens, between score and train (on-policy distillation): CPU, like score."""
    node = teach(cfg=cfg.distill, rollout=cfg.rollout, reward=cfg.reward, teacher=teacher, batch=batch, iteration=iteration, root=cfg.run_root)
    return node.with_overrides(**stage_overrides(cfg, "teacher"))


def trained_on(cfg: RunConfig, ckpt, batch, reference: Policy, iteration: int, code: str):
    """The train task of one iteration on a scored batch: the recipe's processes (nnodes x nproc_per_node), GPUs and memory."""
    node = train_task(cfg.train, cfg.cluster)(
        algo=cfg.algo,
        cfg=cfg.train,
        reward=cfg.reward,
        rollout=cfg.rollout,
        hooks=cfg.hooks,
        health=cfg.health,
        debug=cfg.debug,
        distill=cfg.distill,
        ckpt=ckpt,
        batch=batch,
        reference=reference,
        iteration=iteration,
        root=cfg.run_root,
        code=code,
    )
    return node.with_overrides(**stage_overrides(cfg, "train"))


def published(cfg: RunConfig, ckpt, parent):
    """The checkpoint exported as the next policy version."""
    node = elastic(publish, cfg.cluster, in_process=cfg.train.backend == "torch")(
        cfg=cfg.publish, train_cfg=cfg.train, ckpt=ckpt, parent=parent, root=cfg.run_root
    )
    return node.with_overrides(**stage_overrides(cfg, "publish"))


def evaluated(cfg: RunConfig, policy: Policy, dataset: Dataset, code: str):
    """The evaluate task on `policy`, its pod sized like the rollout's (the GPUs of the SGLang servers it launches)."""
    node = evaluate(cfg=cfg.evaluation, reward=cfg.reward, data=cfg.data, rollout=cfg.rollout, policy=policy, dataset=dataset, code=code)
    return node.with_overrides(**stage_overrides(cfg, "evaluate"))


def phased(cfg: RunConfig, ckpt, policy, reference: Policy, dataset: Dataset, state, buffer, first_iteration: int, steps: int, code: str):
    """An async phase of `steps` training steps on the recipe's Ray cluster (its head and worker groups: tasks/async_phase.py)."""
    node = on_ray(cfg)(
        cfg=cfg.async_phase,
        rollout=cfg.rollout,
        data=cfg.data,
        reward=cfg.reward,
        algo=cfg.algo,
        train=cfg.train,
        hooks=cfg.hooks,
        health=cfg.health,
        publish_cfg=cfg.publish,
        ckpt=ckpt,
        policy=policy,
        reference=reference,
        dataset=dataset,
        state=state,
        buffer=buffer,
        first_iteration=first_iteration,
        steps=steps,
        root=cfg.run_root,
        code=code,
    )
    return node.with_overrides(**stage_overrides(cfg, "async"))


def kept(cfg: RunConfig, recent: Kept, ckpt, policy, done: int, logged: dict) -> Kept:
    """The newest cluster.keep_checkpoints checkpoints and the policies published from them, oldest first, once `ckpt`
    and `policy` are written after `done` iterations (`recent`: the newest ones before them). The checkpoint they leave
    behind is pruned, with its policy where cluster.keep_policies is false, once `ckpt` exists and the node that logged
    that policy (`logged`: iterations done -> that node, of this block) has run; unless it is kept for good
    (miles_core.loop_plan `retired`) or `recent` does not hold it (a replay that keeps more than its parent did). The
    SFT policy, which the converted checkpoint holds, is the reference: never pruned. Empty where every checkpoint is kept."""
    keep, every = cfg.cluster.keep_checkpoints, cfg.cluster.keep_checkpoints_every
    if not keep:
        return Kept([], [])
    written = checkpoints_written(phase_plan(cfg.iterations, cfg.async_phase, cfg.evaluation.interval))
    before = written[: written.index(done)]
    held = before[len(before) - len(recent.checkpoints) :]  # the iterations done when each of `recent` was written
    gone = retired(written, done, keep, every)
    if gone in held:
        at = held.index(gone)
        also = recent.policies[at] if gone and not cfg.cluster.keep_policies else None
        node = prune_iteration(ckpt=recent.checkpoints[at], policy=also, newer=_own(ckpt), iterations_done=gone, keep=keep, every=every)
        if gone in logged:
            logged[gone] >> node  # the tracking reads the policy's manifest first (on a cluster, a branch of its own)
        node.with_overrides(retries=cfg.cluster.retries)  # an object store's hiccup is retried as in every stage
    return Kept([*recent.checkpoints, _own(ckpt)][-keep:], [*recent.policies, _own(policy)][-keep:])


def _own(value):
    """`value` as a promise of its own, for one more node to take: a local run resolves the attribute path of the promise
    a node takes (a task output's field, `trained.ckpt`) in place, so a second node given the same promise would
    resolve it again, from the field's value (flytekit 1.16 `resolve_attr_path_in_promise`)."""
    return value.deepcopy() if isinstance(value, Promise) else value
