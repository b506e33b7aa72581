"""Preparation tasks: a recipe file read and checked, the base model (a user's checkpoint, or the tiny one built
deterministically), its admission, and the prompt data (generated, or the user's files from a path or the object store)."""

from __future__ import annotations

import shutil
from pathlib import Path

from flytekit import task
from flytekit.core.context_manager import FlyteContextManager
from flytekit.types.file import FlyteFile

from containers.images import cpu_image
from miles_core.config import ConfigError, DataConfig, ModelConfig, RolloutConfig, RunConfig, TrainConfig, load_recipe
from miles_core.config.recipe import parse_overrides
from miles_core.data.problems import make_problem_set, write_jsonl
from miles_core.data.source import DataError, load_prompts
from miles_core.models.source import admit, fetch_base, is_uri
from miles_core.plugins import check_plugins
from miles_core.storage import atomic_file, sha256_file
from tasks.common import Dataset, Policy, cache_version, new_artifact, uploaded_dir, uploaded_file, uri_of
from tasks.metadata import MEDIUM, SMALL, cached, declared
from tasks.retry import recoverable

RECIPES = Path(__file__).resolve().parents[1] / "recipes"  # the recipes the image holds


def download_uri(uri: str, local: str, is_multipart: bool = True) -> None:
    """An object-store directory (or file) into `local`, through the execution's file access (its credentials and retries)."""
    FlyteContextManager.current_context().file_access.get_data(uri, local, is_multipart=is_multipart)


@task(container_image=cpu_image, **declared("read_recipe", SMALL, minutes=10))
@recoverable
def read_recipe(recipe: FlyteFile, overrides: list[str]) -> RunConfig:
    """A recipe file (from the object store, or any place flytekit reads) with `key=value` overrides, checked key by key
    and its plug-in modules imported before any other task runs; an error names the file as given and the key.
    `extends:` is read beside the file, else among the recipes the image holds."""
    local = recipe.download()
    try:
        cfg = load_recipe(local, parse_overrides(overrides), library=RECIPES)
    except ConfigError as err:
        raise ConfigError(str(err).replace(str(local), uri_of(recipe))) from None
    check_plugins(cfg)
    return cfg


@task(**cached(cache_version(ModelConfig, module=__name__)), container_image=cpu_image, **declared("base_model", MEDIUM, minutes=240))
@recoverable
def base_model(cfg: ModelConfig, root: str) -> Policy:
    """The base policy as version 0: the checkpoint model.path names, or the tiny model; its source and digest in source.json."""
    out, dest = new_artifact(root, "base", 0, cfg)
    record = fetch_base(cfg, out, download_uri)
    print(f"base model: {record['path']} (sha256 {record['sha256'][:12]})")
    return Policy(dir=uploaded_dir(out, dest), version=0)


@task(**cached(cache_version(TrainConfig, RolloutConfig, module=__name__)), container_image=cpu_image, **declared("admit_model", MEDIUM, minutes=60))
@recoverable
def admit_model(base: Policy, train: TrainConfig, rollout: RolloutConfig) -> Policy:
    """The base policy, once the boundary check passed (whole weights, fitting tokenizer, an architecture and
    shape the trainer backend and the rollout engine take); every later stage starts from this output, so a refusal comes first."""
    admit(base.dir.download(), train, rollout)
    return base


@task(**cached(cache_version(DataConfig, module=__name__)), container_image=cpu_image, **declared("make_data", MEDIUM, minutes=60))
@recoverable
def make_data(cfg: DataConfig, root: str) -> Dataset:
    """The problem set's splits, or the user's prompt files checked row by row and copied in."""
    out, dest = new_artifact(root, "data", 0, cfg)
    if cfg.train_file:
        train, test = (
            _checked_copy(cfg, source, out / f"{name}{Path(source).suffix}") for name, source in (("train", cfg.train_file), ("test", cfg.test_file))
        )
    else:
        train, test = out / "train.jsonl", out / "test.jsonl"
        for rows, path in zip(make_problem_set(cfg), (train, test)):
            write_jsonl(rows, path)
    return Dataset(train=uploaded_file(train, f"{dest}/{train.name}"), test=uploaded_file(test, f"{dest}/{test.name}"), sha256=sha256_file(train))


def _checked_copy(cfg: DataConfig, source: str, dest: Path) -> Path:
    """A prompt file (a path, or an object-store URI downloaded first) checked row by row and copied to `dest`."""
    local = str(dest.with_name(f"downloaded-{dest.name}")) if is_uri(source) else source
    if is_uri(source):
        download_uri(source, local, is_multipart=False)
    try:
        load_prompts(local, cfg.input_key, cfg.label_key, cfg.metadata_key)  # fails naming file, row and key
    except DataError as err:
        raise DataError(str(err).replace(local, source)) from None
    with atomic_file(dest) as tmp:
        shutil.copyfile(local, tmp)
    return dest
