"""The distillation teacher: its checkpoint admitted against the policy's vocabulary, and its log-probs of a batch.

The teacher is any HF checkpoint `model.path` accepts (`distill.teacher`: a directory or an object-store URI, fetched
the same way, models/source.py `fetch_base`). It must be whole and share the policy's vocabulary: it scores the
student's token ids as they are, so one id must mean one token to both. It runs as a frozen torch model whose
log-probs are computed as the trainer computes the policy's (`TorchTrainer.logprobs`: the same packing, temperature
and precision handling), so log pi_s - log pi_t compares like with like.

`score_with_teacher` is the step's teacher stage, between score and train: the sync loop runs it in its own cached
task (tasks/distill.py), which stores each sample's `teacher_logprobs` in the batch; `step.optimize` turns them into
advantages (algos/distill.py).
"""

from __future__ import annotations

import dataclasses
import time

from miles_core.config import DistillConfig, RolloutConfig, TrainConfig
from miles_core.models.source import admit
from miles_core.models.tokenizers import load_tokenizer
from miles_core.samples import Sample
from miles_core.train.backends import trainer_class
from miles_core.train.base import Trainer, pack
from miles_core.weights.check import CheckpointError


def admit_teacher(teacher_dir: str, policy_dir: str, teacher_name: str, policy_name: str) -> None:
    """Raise CheckpointError unless the teacher at teacher_dir is a whole checkpoint whose tokenizer fits its embedding
    and equals the policy's token for token; the names (where each came from) are what the message shows."""
    admit(teacher_dir, TrainConfig(), RolloutConfig())  # the torch model and the torch engine: no backend or server to fit
    teacher, policy = (load_tokenizer(d).get_vocab() for d in (teacher_dir, policy_dir))
    differing = sorted(token for token in teacher.keys() | policy.keys() if teacher.get(token) != policy.get(token))
    if differing:
        token = min(differing, key=lambda t: min(teacher.get(t, len(teacher)), policy.get(t, len(policy))))  # the lowest id first
        raise CheckpointError(
            f"distill.teacher: the teacher's tokenizer ({teacher_name}, {len(teacher)} tokens) differs from the policy's "
            f"({policy_name}, {len(policy)} tokens): token {token!r} is id {teacher.get(token)} in the teacher's and "
            f"{policy.get(token)} in the policy's ({len(differing)} tokens differ). The teacher scores the student's token ids "
            "as they are: distil from a teacher with the policy's tokenizer"
        )


def load_teacher(cfg: DistillConfig, teacher_dir: str) -> Trainer:
    """The teacher as a frozen torch model (only its `logprobs` are used), in cfg.dtype, cfg.micro_batch_size sequences a pass."""
    train_cfg = TrainConfig(micro_batch_size=cfg.micro_batch_size, dtype=cfg.dtype)
    return trainer_class(train_cfg).from_hf(teacher_dir, train_cfg)  # admitted already (admit_teacher): not checked again


def score_with_teacher(teacher: Trainer, samples: list[Sample], pad_id: int, temperature: float) -> dict[str, float]:
    """Fill each sample's teacher_logprobs (one per response token) with the teacher's log-prob of the token at
    `temperature` (the rollout's, as the student's are taken); returns the stage's metrics."""
    started = time.perf_counter()
    batch = dataclasses.replace(pack(samples, pad_id), routed_experts=None)  # the student's routing is no concern of the teacher's routers
    logprobs = teacher.logprobs(batch, temperature)  # [B, T]
    for sample, row in zip(samples, logprobs):
        sample.teacher_logprobs = row[: len(sample.response_tokens)].tolist()
    return {"time/teacher_s": time.perf_counter() - started}
