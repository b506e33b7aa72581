"""On-policy distillation's tasks: the teacher's checkpoint fetched and admitted, and a scored batch scored by the teacher.

Both are cached like every stage. `teacher_model` runs once a run, keyed by the teacher's path and the policy whose
tokenizer it must share; `teach` runs every iteration between score and train and writes the batch again with each
sample's teacher log-probs, checked by the batch schema on the way out and by the train task on the way in
(miles_core/schemas.py `DistilledBatchSchema`). The workflow places them (workflows/nodes.py) when distill.teacher is set.
"""

from __future__ import annotations

from flytekit import task

from containers.images import cpu_image
from miles_core.batch_io import read_batch, write_batch
from miles_core.config import DistillConfig, ModelConfig, RewardConfig, RolloutConfig
from miles_core.distill import admit_teacher, load_teacher, score_with_teacher
from miles_core.models import vocab_size
from miles_core.models.source import fetch_base
from miles_core.models.tokenizers import load_tokenizer
from tasks.common import BatchResult, Policy, cache_version, new_artifact, uploaded_dir, uploaded_file, uri_of
from tasks.metadata import MEDIUM, cached, declared
from tasks.prepare import download_uri
from tasks.retry import recoverable


@task(**cached(cache_version(module=__name__)), container_image=cpu_image, **declared("teacher_model", MEDIUM, minutes=240))
@recoverable
def teacher_model(path: str, policy: Policy, root: str) -> Policy:
    """The teacher checkpoint at `path` (distill.teacher: a directory or an object-store URI) among the run's artifacts,
    once it is whole and its tokenizer is the policy's token for token; its source and digest in source.json."""
    out, dest = new_artifact(root, "teacher", 0, path, uri_of(policy.dir))
    record = fetch_base(ModelConfig(path=path), out, download_uri, key="distill.teacher")
    admit_teacher(str(out), policy.dir.download(), path, uri_of(policy.dir))
    print(f"distillation teacher: {record['path']} (sha256 {record['sha256'][:12]})")
    return Policy(dir=uploaded_dir(out, dest), version=0)


@task(**cached(cache_version(DistillConfig, RolloutConfig, RewardConfig, module=__name__)), container_image=cpu_image, **declared("teacher"))
@recoverable
def teach(cfg: DistillConfig, rollout: RolloutConfig, reward: RewardConfig, teacher: Policy, batch: BatchResult, iteration: int, root: str) -> BatchResult:
    """The teacher's log-prob of every response token of a scored batch, at the rollout's temperature (miles_core/distill.py)."""
    teacher_dir = teacher.dir.download()
    shape = {"scored": True, "reward_range": (reward.min, reward.max), "vocab_size": vocab_size(teacher_dir), "group_size": rollout.n_samples}
    samples = read_batch(batch.batch.download(), **shape)
    pad_id = load_tokenizer(teacher_dir).pad_token_id
    metrics = score_with_teacher(load_teacher(cfg, teacher_dir), samples, pad_id, rollout.temperature)
    out, dest = new_artifact(root, "distilled", iteration, cfg, rollout, uri_of(teacher.dir), uri_of(batch.batch), suffix=".parquet")
    write_batch(samples, out, distilled=True, **shape)
    return BatchResult(batch=uploaded_file(out, dest), metrics={**batch.metrics, **metrics})
