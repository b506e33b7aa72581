"""Preparation tasks: the base model and the prompt data, both built deterministically."""

from __future__ import annotations

import shutil
from pathlib import Path

from flytekit import task

from containers.images import cpu_image
from miles_core.config import DataConfig, ModelConfig
from miles_core.data.problems import make_problem_set, write_jsonl
from miles_core.data.source import load_prompts
from miles_core.models.tiny import build_tiny_model
from miles_core.storage import artifact_path, atomic_file, sha256_file
from tasks.common import Dataset, Policy, cache_version, lasting_dir, lasting_file


@task(cache=True, cache_version=cache_version(ModelConfig, module=__name__), container_image=cpu_image)
def build_model(cfg: ModelConfig, root: str) -> Policy:
    """The tiny base policy (HF directory) as version 0."""
    out = artifact_path(root, "base", 0, cfg)
    return Policy(dir=lasting_dir(build_tiny_model(cfg, str(out))), version=0)


@task(cache=True, cache_version=cache_version(DataConfig, module=__name__), container_image=cpu_image)
def make_data(cfg: DataConfig, root: str) -> Dataset:
    """The problem set's splits, or the user's prompt files checked row by row and copied in."""
    out = artifact_path(root, "data", 0, cfg)
    if cfg.train_file:
        train, test = (
            _checked_copy(cfg, source, out / f"{name}{Path(source).suffix}") for name, source in (("train", cfg.train_file), ("test", cfg.test_file))
        )
    else:
        train, test = out / "train.jsonl", out / "test.jsonl"
        for rows, path in zip(make_problem_set(cfg), (train, test)):
            write_jsonl(rows, path)
    return Dataset(train=lasting_file(train), test=lasting_file(test), sha256=sha256_file(train))


def _checked_copy(cfg: DataConfig, source: str, dest: Path) -> Path:
    load_prompts(source, cfg.input_key, cfg.label_key, cfg.metadata_key)  # fails naming file, row and key
    with atomic_file(dest) as tmp:
        shutil.copyfile(source, tmp)
    return dest
