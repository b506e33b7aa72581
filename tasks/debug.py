"""The tasks of the debug modes (docs/debug.md): a scored batch exported as a readable dataset, and a dataset file
admitted as a scored batch to train on. The dump itself (`dumped`) is also what the train task writes when
`debug.dump_rollouts` is on, with the step's advantages and trainer log-probs."""

from __future__ import annotations

import os

import pandas as pd
from flytekit import task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from containers.images import cpu_image
from miles_core.batch_io import read_batch, write_batch
from miles_core.config import RewardConfig, RolloutConfig
from miles_core.dump import read_rollouts, readable_frame, write_dump
from miles_core.models import vocab_size
from miles_core.models.tokenizers import load_tokenizer
from miles_core.samples import Sample
from tasks.common import BatchResult, Policy, cache_version, new_artifact, uploaded_dir, uploaded_file, uri_of
from tasks.decks import batch_decks
from tasks.metadata import cached, declared
from tasks.retry import recoverable


def dumped(frame: pd.DataFrame, root: str, iteration: int, *inputs: object) -> FlyteDirectory:
    """A readable frame as rollouts.parquet and rollouts.jsonl, uploaded to <root>/dump/<iteration>-<digest of inputs>."""
    out, dest = new_artifact(root, "dump", iteration, *inputs)
    return uploaded_dir(write_dump(frame, out), dest)


def train_outputs(samples: list[Sample], tokenizer_dir: str, trace: dict, metrics: dict[str, float], dump_to: tuple | None) -> FlyteDirectory | None:
    """On the process whose value and decks an Elastic task returns (rank 0): the train task's decks and, when
    `dump_to` is (root, iteration, *inputs), the batch dumped with the step's advantages and trainer log-probs."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    tokenizer = load_tokenizer(tokenizer_dir)
    batch_decks(samples, tokenizer, metrics, trace)
    return dumped(readable_frame(samples, tokenizer, trace), *dump_to) if dump_to else None


@task(**cached(cache_version(RolloutConfig, module=__name__)), container_image=cpu_image, **declared("score"))
@recoverable
def dump(rollout: RolloutConfig, policy: Policy, batch: BatchResult, iteration: int, root: str) -> FlyteDirectory:
    """A scored batch as a readable dataset (no train step: no advantages or trainer log-probs)."""
    policy_dir = policy.dir.download()
    samples = read_batch(batch.batch.download(), scored=True, vocab_size=vocab_size(policy_dir), group_size=rollout.n_samples)
    return dumped(readable_frame(samples, load_tokenizer(policy_dir)), root, iteration, uri_of(batch.batch))


@task(**cached(cache_version(RewardConfig, RolloutConfig, module=__name__)), container_image=cpu_image, **declared("score"))
@recoverable
def admit_rollouts(reward: RewardConfig, rollout: RolloutConfig, policy: Policy, rollouts: FlyteFile, iteration: int, root: str) -> BatchResult:
    """A dump or a user's file of the same columns (.jsonl or parquet) as the scored batch of one train step: every row
    checked against the policy's vocabulary, the reward range and whole groups of rollout.n_samples; a bad one
    fails here, naming the file, the row and the column."""
    shape = {"reward_range": (reward.min, reward.max), "vocab_size": vocab_size(policy.dir.download()), "group_size": rollout.n_samples}
    samples = read_rollouts(rollouts.download(), **shape, name=uri_of(rollouts))  # named as given, not where it was downloaded to
    out, dest = new_artifact(root, "scored", iteration, uri_of(rollouts), uri_of(policy.dir), reward, rollout, suffix=".parquet")
    write_batch(samples, out, scored=True, **shape)
    rewards = [s.reward for s in samples]
    return BatchResult(batch=uploaded_file(out, dest), metrics={"reward/mean": sum(rewards) / len(rewards), "rollout/samples": float(len(samples))})
