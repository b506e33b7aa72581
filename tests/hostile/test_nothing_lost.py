"""A refused later input loses nothing already produced: a run root holds a published policy version
and a written batch; then a malformed batch, recipe, prompt file, weight directory and manifest are
fed through the same functions into the same root. Each is refused, and every earlier file is
byte-identical (sha256) and still reads back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from miles_core.batch_io import read_batch, write_batch
from miles_core.config import ModelConfig
from miles_core.config.base import ConfigError
from miles_core.config.recipe import load_recipe
from miles_core.data.source import DataError, load_prompts
from miles_core.models.tiny import build_tiny_model
from miles_core.samples import Sample
from miles_core.schemas import BatchError
from miles_core.storage import sha256_file
from miles_core.weights.check import CheckpointError, check_hf_dir
from miles_core.weights.manifest import read_manifest, write_manifest


def batch(n: int) -> list[Sample]:
    return [Sample(f"p{i // 2}", i % 2, [5, 6], [8, 2], [-0.5, -1.0], [1, 1], "stop", 1, "7", {}, 1.0) for i in range(n)]


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    build_tiny_model(ModelConfig(), directory)
    return directory


@pytest.fixture
def run_root(tmp_path, tiny) -> Path:
    root = tmp_path / "run"
    policy = root / "policies" / "v0001"
    shutil.copytree(tiny, policy)
    write_manifest(policy, 1, None, "tiny")
    write_batch(batch(4), root / "batches" / "step-0001.parquet", group_size=2)
    (root / "recipe.yaml").write_text("name: kept\niterations: 2\n")
    (root / "prompts.jsonl").write_text('{"input": "1+1=", "label": "2"}\n')
    return root


def refuse_batch(root: Path):
    with pytest.raises(BatchError, match="whole_groups_of"):
        write_batch(batch(3), root / "batches" / "step-0001.parquet", group_size=2)


def refuse_next_batch(root: Path):
    with pytest.raises(BatchError):
        write_batch(batch(3), root / "batches" / "step-0002.parquet", group_size=2)


def refuse_recipe(root: Path):
    (root / "next.yaml").write_text("name: a\nname: b\n")
    with pytest.raises(ConfigError, match="duplicate key 'name'"):
        load_recipe(root / "next.yaml")


def refuse_recipe_override(root: Path):
    with pytest.raises(ConfigError, match="train.lr: must be a finite number"):
        load_recipe(root / "recipe.yaml", {"train.lr": float("nan")})


def refuse_prompts(root: Path):
    (root / "more.jsonl").write_bytes(b'{"input": "\xff", "label": "1"}\n')
    with pytest.raises(DataError, match="more.jsonl"):
        load_prompts(root / "more.jsonl")


def refuse_policy(root: Path):
    broken = root / "policies" / "v0002"
    shutil.copytree(root / "policies" / "v0001", broken)
    (broken / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="v0002/config.json: not JSON"):
        check_hf_dir(broken)


def refuse_manifest(root: Path):
    (root / "policies" / "v0003").mkdir()
    (root / "policies" / "v0003" / "policy.json").write_text(json.dumps({"version": "3"}))
    with pytest.raises(CheckpointError, match="key version: expected int"):
        read_manifest(root / "policies" / "v0003")


REFUSALS = [refuse_batch, refuse_next_batch, refuse_recipe, refuse_recipe_override, refuse_prompts, refuse_policy, refuse_manifest]


@pytest.mark.parametrize("refuse", REFUSALS, ids=[f.__name__ for f in REFUSALS])
def test_a_refused_input_leaves_every_earlier_product_intact(run_root, refuse):
    before = digests(run_root)
    refuse(run_root)
    after = digests(run_root)
    assert {k: after.get(k) for k in before} == before  # nothing earlier changed or vanished
    assert not any(k.startswith("batches/step-0002") for k in after)  # a refused batch leaves no file
    policy = run_root / "policies" / "v0001"
    check_hf_dir(policy)
    assert read_manifest(policy)["version"] == 1
    assert [s.sample_id for s in read_batch(run_root / "batches" / "step-0001.parquet", group_size=2)] == ["p0/0", "p0/1", "p1/0", "p1/1"]
    assert load_recipe(run_root / "recipe.yaml").name == "kept"
    assert [p.label for p in load_prompts(run_root / "prompts.jsonl")] == ["2"]
