"""Malformed weight directories, each made by corrupting one copy of a real tiny checkpoint: each is
refused by `check_hf_dir` (and so by the rollout engine's loader) with a short CheckpointError naming
the file and the key or tensor, before any weight is loaded; so is a malformed policy manifest."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_core.config import AlgoConfig, ModelConfig, TrainConfig
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.train.backends import convert_checkpoint, make_trainer
from miles_core.weights.check import MAX_JSON_BYTES, CheckpointError, check_hf_dir
from miles_core.weights.manifest import read_manifest, write_manifest

WEIGHTS = "model.safetensors"
EMBED = "model.embed_tokens.weight"
GATE = "model.layers.0.mlp.gate_proj.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    build_tiny_model(ModelConfig(), directory)
    return directory


def edit_config(**changes):
    def corrupt(d: Path):
        config = json.loads((d / "config.json").read_text())
        config.update(changes)
        for key in [k for k, v in changes.items() if v is None]:
            del config[key]
        (d / "config.json").write_text(json.dumps(config))

    return corrupt


def write(name: str, blob: bytes):
    return lambda d: (d / name).write_bytes(blob)


def remove(name: str):
    return lambda d: (d / name).unlink()


def truncate(name: str, keep):
    return lambda d: os.truncate(d / name, keep((d / name).stat().st_size))


def edit_tensors(change):
    def corrupt(d: Path):
        tensors = load_file(str(d / WEIGHTS))
        change(tensors)
        save_file(tensors, str(d / WEIGHTS))

    return corrupt


def replace_header_length(d: Path):
    blob = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes((2**62).to_bytes(8, "little") + blob[8:])


def shard_index(weight_map):
    return write("model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": weight_map}).encode())


def make_directory(name: str):
    def corrupt(d: Path):
        (d / name).unlink()
        (d / name).mkdir()

    return corrupt


# (case, corruption of a copy of the good directory, text the error holds, file the error names)
CASES = [
    ("config-missing", remove("config.json"), "missing (the model's config)", "config.json"),
    ("config-empty", write("config.json", b""), "not JSON (line 1, column 1", "config.json"),
    ("config-truncated", truncate("config.json", lambda n: n // 2), "not JSON", "config.json"),
    ("config-list", write("config.json", b"[1, 2]"), "expected a JSON object, got list", "config.json"),
    ("config-latin1", write("config.json", '{"model_type": "qwén2"}'.encode("latin-1")), "not UTF-8 (byte 18)", "config.json"),
    ("config-binary", write("config.json", bytes(range(256))), "not UTF-8", "config.json"),
    ("config-oversize", truncate("config.json", lambda n: MAX_JSON_BYTES + 1), f"more than {MAX_JSON_BYTES}", "config.json"),
    ("config-directory", make_directory("config.json"), "missing (the model's config)", "config.json"),
    ("model-type-missing", edit_config(model_type=None), "key model_type: expected a name, got None", "config.json"),
    ("model-type-number", edit_config(model_type=3), "key model_type: expected a name, got 3", "config.json"),
    ("model-type-unknown", edit_config(model_type="no_such_architecture"), "transformers cannot build a model from it", "config.json"),
    ("model-type-huge", edit_config(model_type="x" * 10_000), "transformers cannot build a model from it", "config.json"),
    ("hidden-size-changed", edit_config(hidden_size=256), f"tensor {EMBED} has shape [", "config.json implies"),
    ("vocab-size-changed", edit_config(vocab_size=999), f"tensor {EMBED} has shape [", "config.json implies"),
    ("intermediate-size-changed", edit_config(intermediate_size=100), f"tensor {GATE} has shape [384, 128], config.json implies [100, 128]", "config.json"),
    ("layers-disagree", edit_config(num_hidden_layers=6), "transformers cannot build a model from it (", "config.json"),
    (
        "more-layers-than-weights",
        edit_config(num_hidden_layers=6, layer_types=["full_attention"] * 6),
        "tensor model.layers.4.",
        "missing from the weight files",
    ),
    ("weights-missing", remove(WEIGHTS), "no model.safetensors (nor model.safetensors.index.json)", ""),
    ("weights-empty", write(WEIGHTS, b""), "not a whole safetensors file", WEIGHTS),
    ("weights-half", truncate(WEIGHTS, lambda n: n // 2), "not a whole safetensors file", WEIGHTS),
    ("weights-one-byte-short", truncate(WEIGHTS, lambda n: n - 1), "not a whole safetensors file", WEIGHTS),
    ("weights-header-only", truncate(WEIGHTS, lambda n: 8), "not a whole safetensors file", WEIGHTS),
    ("weights-huge-header-length", replace_header_length, "not a whole safetensors file", WEIGHTS),
    ("weights-junk", write(WEIGHTS, bytes(range(256)) * 4), "not a whole safetensors file", WEIGHTS),
    ("weights-json-not-safetensors", write(WEIGHTS, b'{"a": 1}'), "not a whole safetensors file", WEIGHTS),
    ("weights-directory", make_directory(WEIGHTS), "missing (a weight shard)", WEIGHTS),
    ("tensor-missing", edit_tensors(lambda t: t.pop(GATE)), f"tensor {GATE} missing from the weight files", ""),
    ("tensors-none", edit_tensors(lambda t: [t.pop(k) for k in list(t)[1:]] and None), "missing from the weight files", ""),
    ("tensor-transposed", edit_tensors(lambda t: t.update({GATE: t[GATE].T.contiguous()})), f"tensor {GATE} has shape [128, 384]", ""),
    ("tensor-flattened", edit_tensors(lambda t: t.update({EMBED: t[EMBED].flatten()})), f"tensor {EMBED} has shape [", ""),
    ("tensor-int", edit_tensors(lambda t: t.update({EMBED: t[EMBED].to(torch.int32)})), f"tensor {EMBED} has dtype I32, expected a floating type", ""),
    ("tensor-bool", edit_tensors(lambda t: t.update({GATE: t[GATE] > 0})), f"tensor {GATE} has dtype BOOL", ""),
    ("tensor-renamed", edit_tensors(lambda t: t.update({"renamed": t.pop(GATE)})), f"tensor {GATE} missing", ""),
    ("index-not-json", write("model.safetensors.index.json", b"{"), "not JSON", "model.safetensors.index.json"),
    ("index-no-weight-map", write("model.safetensors.index.json", b"{}"), "key weight_map: expected an object", "index.json"),
    ("index-map-list", shard_index(["model.safetensors"]), "key weight_map: expected an object", "index.json"),
    ("index-shard-missing", shard_index({EMBED: "model-00002-of-00002.safetensors"}), "missing (a weight shard)", "model-00002-of-00002.safetensors"),
    ("index-shard-escapes", shard_index({EMBED: "../outside.safetensors"}), "shard names must be plain file names", "index.json"),
    ("tokenizer-missing", remove("tokenizer.json"), "no tokenizer (tokenizer.json, tokenizer.model or vocab.json)", ""),
    ("tokenizer-corrupt", write("tokenizer.json", b'{"model": '), "not JSON", "tokenizer.json"),
    ("tokenizer-config-corrupt", write("tokenizer_config.json", b"\xff\xfe"), "not UTF-8 (byte 0)", "tokenizer_config.json"),
    ("tokenizer-config-list", write("tokenizer_config.json", b"[]"), "expected a JSON object, got list", "tokenizer_config.json"),
    ("generation-config-corrupt", write("generation_config.json", b"nan"), "not JSON", "generation_config.json"),
]


def assert_short(message: str) -> None:
    assert len(message) <= 500 and message.count("\n") < 5 and "Traceback" not in message, message[:600]


@pytest.mark.parametrize(("case", "corrupt", "expected", "names"), CASES, ids=[c[0] for c in CASES])
def test_a_malformed_weight_directory_is_refused_naming_the_file_and_tensor(good, tmp_path, case, corrupt, expected, names):
    directory = tmp_path / "policy"
    shutil.copytree(good, directory)
    corrupt(directory)
    with pytest.raises(CheckpointError) as err:
        check_hf_dir(directory)
    message = str(err.value)
    assert message.startswith(str(directory)) and expected in message and names in message, message[:300]
    assert_short(message)


@pytest.mark.parametrize("make", [lambda p: p.write_text("x"), lambda p: None], ids=["a-file", "absent"])
def test_a_path_that_is_no_directory_is_refused(tmp_path, make):
    path = tmp_path / "policy"
    make(path)
    with pytest.raises(CheckpointError, match="not a directory"):
        check_hf_dir(path)


def test_the_good_directory_passes_and_the_engine_refuses_a_corrupt_one_before_loading(good, tmp_path):
    check_hf_dir(good)
    engine = TorchEngine(str(good), version=1)
    broken = tmp_path / "broken"
    shutil.copytree(good, broken)
    edit_tensors(lambda t: t.pop(GATE))(broken)
    with pytest.raises(CheckpointError, match=f"tensor {GATE} missing"):
        engine.load_weights(str(broken), version=2)
    assert engine.weight_version == 1 and engine.policy_dir == str(good)


MANIFESTS = [
    ("absent", None, "policy.json: missing (the policy manifest)"),
    ("not-json", b"{version: 1}", "policy.json: not JSON"),
    ("list", b"[1]", "expected a JSON object, got list"),
    ("version-missing", {"parent_version": None, "source": "s", "weights_sha256": "0"}, "key version missing"),
    ("version-text", {"version": "3", "parent_version": None, "source": "s", "weights_sha256": "0"}, "key version: expected int, got str"),
    ("version-bool", {"version": True, "parent_version": None, "source": "s", "weights_sha256": "0"}, "key version: expected int, got bool"),
    ("parent-float", {"version": 1, "parent_version": 0.5, "source": "s", "weights_sha256": "0"}, "key parent_version: expected int or NoneType"),
    ("sha-number", {"version": 1, "parent_version": None, "source": "s", "weights_sha256": 7}, "key weights_sha256: expected str, got int"),
]


@pytest.mark.parametrize(("case", "content", "expected"), MANIFESTS, ids=[c[0] for c in MANIFESTS])
def test_a_malformed_policy_manifest_is_refused_naming_the_key(tmp_path, case, content, expected):
    if content is not None:
        (tmp_path / "policy.json").write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    with pytest.raises(CheckpointError) as err:
        read_manifest(tmp_path)
    assert expected in str(err.value) and str(tmp_path / "policy.json") in str(err.value)
    assert_short(str(err.value))


def test_a_written_manifest_reads_back(good, tmp_path):
    directory = tmp_path / "v1"
    shutil.copytree(good, directory)
    assert write_manifest(directory, 1, None, "ckpt") == read_manifest(directory)


def test_the_corpus_is_large_enough():
    assert len(CASES) + len(MANIFESTS) + 2 >= 30


def test_training_refuses_a_malformed_base_checkpoint_before_any_compute(tmp_path, good):
    """The trainer's entry points (conversion of the base checkpoint, the KL reference) check the
    HF directory first: a truncated weight file fails naming the file, and nothing is written."""
    broken = tmp_path / "broken"
    shutil.copytree(good, broken)
    truncate(WEIGHTS, lambda size: size // 2)(broken)
    out = tmp_path / "ckpt"
    for call in (lambda: convert_checkpoint(TrainConfig(), AlgoConfig(), str(broken), out), lambda: make_trainer(TrainConfig(), str(broken))):
        with pytest.raises(CheckpointError, match="model.safetensors"):
            call()
    assert not out.exists()
