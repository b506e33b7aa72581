"""The debug modes (docs/debug.md): rollout without training, and training without rollout.

    pyflyte run workflows/debug.py rollout_only --cfg "$(python -m miles_core.config recipes/smoke.yaml)"
    pyflyte run workflows/debug.py train_only --cfg "$(python -m miles_core.config recipes/smoke.yaml)" \
        --rollouts '["runs/dump/0000-<digest>/rollouts.jsonl"]'

Composition only, of the RL workflow's cached tasks on the recipe's policy (the base model after SFT, as `rl` starts):
`rollout_only` rolls out and scores cfg.iterations batches from it and dumps each as a readable dataset, training
nothing; `train_only` trains one step per dataset file (a dump's parquet or JSONL, or a user's file of its columns,
admitted row by row) and publishes the policy after each, rolling out nothing.
"""

from __future__ import annotations

from typing import NamedTuple

from flytekit import dynamic, workflow
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from containers.images import cpu_image
from miles_core.config import RunConfig
from miles_core.data.source import DataState
from miles_core.plugins import plugin_code
from tasks.common import Dataset, Policy
from tasks.debug import admit_rollouts, dump
from tasks.metadata import BUILDER
from tasks.prepare import admit_model, base_model, make_data
from tasks.sft import sft
from workflows.nodes import converted, published, rolled_out, scored, trained_on


class TrainOnlyResult(NamedTuple):
    policy: Policy  # the policy published after the last step
    metrics: list[dict[str, float]]  # each step's training metrics


@dynamic(container_image=cpu_image, **BUILDER)
def rollout_loop(cfg: RunConfig, start: Policy, dataset: Dataset) -> list[FlyteDirectory]:
    """cfg.iterations batches from `start`, each rolled out, scored and dumped: the data source and the buffer move on
    from batch to batch as in `rl`, the policy does not."""
    state, buffer, dumps = DataState(), None, []
    for it in range(cfg.iterations):
        batch = rolled_out(cfg, start, dataset, state, buffer, it, plugin_code(cfg, "rollout"))
        rewarded = scored(cfg, start, batch, it, plugin_code(cfg, "score"))
        dumps.append(dump(rollout=cfg.rollout, policy=start, batch=rewarded, iteration=it, root=cfg.run_root))
        state, buffer = batch.state, batch.buffer
    return dumps


@dynamic(container_image=cpu_image, **BUILDER)
def train_loop(cfg: RunConfig, start: Policy, rollouts: list[FlyteFile]) -> TrainOnlyResult:
    """One train step and publish per file, in order, from `start` (also the KL reference)."""
    ckpt, policy, metrics = converted(cfg, start), start, []
    for it, rows in enumerate(rollouts):
        batch = admit_rollouts(reward=cfg.reward, rollout=cfg.rollout, policy=start, rollouts=rows, iteration=it, root=cfg.run_root)
        trained = trained_on(cfg, ckpt, batch, start, it, plugin_code(cfg, "train"))
        policy = published(cfg, trained.ckpt, policy)
        ckpt = trained.ckpt
        metrics.append(trained.metrics)
    return policy, metrics


def recipe_policy(cfg: RunConfig) -> tuple:
    """(prompt files, policy) as `rl` starts from them: the admitted base model after SFT; cached, so shared with it."""
    base = admit_model(base=base_model(cfg=cfg.model, root=cfg.run_root), train=cfg.train, rollout=cfg.rollout)
    dataset = make_data(cfg=cfg.data, root=cfg.run_root)
    return dataset, sft(cfg=cfg.sft, data=cfg.data, base=base, dataset=dataset, root=cfg.run_root)


@workflow
def rollout_only(cfg: RunConfig = RunConfig()) -> list[FlyteDirectory]:  # noqa: B008 (the workflow's default input, frozen)
    """cfg.iterations rollout batches of the recipe's policy, scored and dumped (rollouts.parquet, rollouts.jsonl)."""
    dataset, start = recipe_policy(cfg)
    return rollout_loop(cfg=cfg, start=start, dataset=dataset)


@workflow
def train_only(rollouts: list[FlyteFile], cfg: RunConfig = RunConfig()) -> TrainOnlyResult:  # noqa: B008 (frozen default)
    """The recipe's policy trained on each dataset file in turn, a policy version published after each."""
    _, start = recipe_policy(cfg)
    return train_loop(cfg=cfg, start=start, rollouts=rollouts)
