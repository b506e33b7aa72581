"""The base model from model.path (a directory or an object-store URI) and its admission before any compute."""

import json
import shutil
from pathlib import Path

import pytest
from flytekit.core.data_persistence import FileAccessProvider

from miles_core.config import ConfigError, ModelConfig, RolloutConfig, SGLangConfig, TrainConfig
from miles_core.models.source import admit, checkpoint_digest, fetch_base, read_source
from miles_core.models.tiny import build_tiny_model
from miles_core.weights.check import CheckpointError

MEGATRON_TP2 = TrainConfig(backend="megatron", tensor_parallel=2, nproc_per_node=2)


def no_download(uri: str, local: str) -> None:
    raise AssertionError(f"nothing should be downloaded, got {uri}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A user's checkpoint: the tiny model saved as any HF directory is (weights, config, tokenizer, generation config)."""
    return Path(build_tiny_model(ModelConfig(seed=3), str(tmp_path_factory.mktemp("user") / "ckpt")))


def user_copy(checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "user"))


def test_without_a_path_the_tiny_model_is_built_and_recorded(tmp_path):
    record = fetch_base(ModelConfig(), tmp_path / "base", no_download)
    assert record == {"path": "tiny:qwen2:seed=0", "sha256": checkpoint_digest(tmp_path / "base")}
    assert read_source(tmp_path / "base") == record
    admit(tmp_path / "base", TrainConfig(), RolloutConfig())


def test_a_local_directory_is_copied_with_its_digest(checkpoint, tmp_path):
    record = fetch_base(ModelConfig(path=str(checkpoint)), tmp_path / "base", no_download)
    assert record == {"path": str(checkpoint), "sha256": checkpoint_digest(checkpoint)}
    assert sorted(p.name for p in (tmp_path / "base").iterdir()) == sorted([*(p.name for p in checkpoint.iterdir()), "source.json"])
    assert not (tmp_path / "base" / "model.safetensors").samefile(checkpoint / "model.safetensors")  # the user's files stay theirs
    admit(tmp_path / "base", MEGATRON_TP2, RolloutConfig())


def test_an_object_store_uri_is_downloaded_through_the_file_access(checkpoint, tmp_path):
    """flytekit's own file access (fsspec) on a file:// URI: the same call reads s3:// or gs:// on a cluster."""
    access = FileAccessProvider(local_sandbox_dir=str(tmp_path / "sandbox"), raw_output_prefix=str(tmp_path / "raw"))
    uri = f"file://{checkpoint}"
    record = fetch_base(ModelConfig(path=uri), tmp_path / "base", lambda remote, local: access.get_data(remote, local, is_multipart=True))
    assert record == {"path": uri, "sha256": checkpoint_digest(checkpoint)}


def test_a_missing_directory_names_the_key(tmp_path):
    with pytest.raises(CheckpointError, match=r"model.path: .*nowhere is no directory here .*object-store URI"):
        fetch_base(ModelConfig(path=str(tmp_path / "nowhere")), tmp_path / "base", no_download)
    assert not (tmp_path / "base").exists()  # nothing half-made left behind


def test_unknown_schemes_are_refused_at_load():
    with pytest.raises(ConfigError, match=r"model.path: unknown scheme in 'hf://Qwen/Qwen3-8B'"):
        ModelConfig(path="hf://Qwen/Qwen3-8B")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "model.safetensors").unlink(), r"no model.safetensors"),
        (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-100]), r"model.safetensors: not a whole safetensors file"),
        (lambda d: [(d / n).unlink() for n in ("tokenizer.json",)], r"no tokenizer \(tokenizer.json"),
        (lambda d: (d / "config.json").write_text("{"), r"config.json: not JSON"),
    ],
    ids=["missing weights", "truncated weights", "missing tokenizer", "corrupt config"],
)
def test_a_broken_checkpoint_is_refused_naming_the_file(checkpoint, tmp_path, damage, message):
    user = user_copy(checkpoint, tmp_path)
    damage(user)
    with pytest.raises(CheckpointError, match=message):
        admit(user, TrainConfig(), RolloutConfig())


def test_a_tokenizer_larger_than_the_embedding_is_refused(checkpoint, tmp_path):
    """Another model's tokenizer saved over this one's: its ids run past the embedding's rows."""
    from transformers import AutoTokenizer

    user = user_copy(checkpoint, tmp_path)
    rows = json.loads((user / "config.json").read_text())["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(user)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(rows + 1 - len(tokenizer))])
    tokenizer.save_pretrained(user)
    with pytest.raises(CheckpointError, match=rf"config.json: key vocab_size: {rows} embedding rows, but the tokenizer has {rows + 1} tokens"):
        admit(user, TrainConfig(), RolloutConfig())


def test_an_architecture_megatron_cannot_train_is_refused_for_megatron_only(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from miles_core.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    admit(tmp_path, TrainConfig(), RolloutConfig())  # the torch backend trains what transformers builds
    with pytest.raises(CheckpointError, match=r"config.json: model_type 'gpt2' cannot train on the megatron backend: not a family .*train.backend: megatron"):
        admit(tmp_path, MEGATRON_TP2, RolloutConfig())


def test_parallel_sizes_are_checked_against_the_checkpoints_shape(checkpoint):
    three = TrainConfig(backend="megatron", tensor_parallel=3, nproc_per_node=3)
    with pytest.raises(ConfigError, match=r"train.tensor_parallel: must divide .*config.json: num_heads \(4\): megatron splits it over 3 ranks"):
        admit(checkpoint, three, RolloutConfig())


def test_a_family_the_cpu_sglang_server_cannot_serve_is_refused_where_it_would_launch_one(tmp_path):
    """The tiny Llama 4 (SGLang 0.5.23's Llama 4 casts q and k to bf16 in its QK norm: an fp32 CPU server fails)."""
    llama4 = build_tiny_model(
        ModelConfig(arch="llama4", hidden_size=64, num_heads=4, intermediate_size=128, num_experts=4, moe_intermediate_size=32), str(tmp_path)
    )
    cpu_sglang = RolloutConfig(engine="sglang")
    with pytest.raises(CheckpointError, match=r"config.json: key model_type: 'llama4': SGLang does not serve it on CPU .*QK norm casts q and k"):
        admit(llama4, TrainConfig(), cpu_sglang)
    admit(llama4, TrainConfig(), RolloutConfig())  # the embedded engine rolls it out
    admit(llama4, TrainConfig(), RolloutConfig(engine="sglang", sglang=SGLangConfig(device="cuda", tensor_parallel=4)))  # on GPUs
    admit(llama4, TrainConfig(), RolloutConfig(engine="sglang", sglang=SGLangConfig(urls="http://10.0.0.7:30000")))  # the user's server


def test_sglang_tensor_parallel_must_divide_the_attention_heads(checkpoint):
    three = RolloutConfig(engine="sglang", sglang=SGLangConfig(device="cuda", tensor_parallel=3))
    with pytest.raises(ConfigError, match=r"rollout.sglang.tensor_parallel: must divide .*config.json: num_attention_heads \(4\)"):
        admit(checkpoint, TrainConfig(), three)


def test_published_versions_keep_every_tokenizer_file_and_digest_sharded_weights(checkpoint, tmp_path):
    """A real checkpoint's tokenizer may be BPE vocab + merges or sentencepiece, beside a generation config;
    its weights may be sharded. Every such file travels on, and the manifest's digest covers every shard."""
    from transformers import AutoModelForCausalLM

    from miles_core.storage import sha256_file
    from miles_core.weights.manifest import weights_sha256
    from miles_core.weights.publish import copy_tokenizer

    user = user_copy(checkpoint, tmp_path)
    (user / "merges.txt").write_text("#version: 0.2\n")
    (user / "vocab.json").write_text("{}")
    (tmp_path / "next").mkdir()
    copy_tokenizer(user, tmp_path / "next")
    assert {"merges.txt", "vocab.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in (tmp_path / "next").iterdir()}
    assert weights_sha256(user) == sha256_file(user / "model.safetensors")

    AutoModelForCausalLM.from_pretrained(user).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1
    digest = weights_sha256(tmp_path / "sharded")
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit of one shard
    assert weights_sha256(tmp_path / "sharded") != digest


@pytest.mark.parametrize(
    ("config", "shape"),
    [
        (
            {"num_attention_heads": 64, "num_key_value_heads": 4, "num_hidden_layers": 94, "intermediate_size": 12288, "num_experts": 128},
            {"num_heads": 64, "num_kv_heads": 4, "num_layers": 94, "intermediate_size": 12288, "num_experts": 128},
        ),
        (
            {"num_attention_heads": 128, "num_hidden_layers": 61, "n_routed_experts": 256},
            {"num_heads": 128, "num_kv_heads": 128, "num_layers": 61, "num_experts": 256},
        ),
        (
            {"text_config": {"num_attention_heads": 40, "num_hidden_layers": 48, "num_local_experts": 16}},
            {"num_heads": 40, "num_kv_heads": 40, "num_layers": 48, "num_experts": 16},
        ),
        ({"num_attention_heads": 32, "layers_block_type": ["mamba", "moe", "attention"] * 4}, {"num_heads": 32, "num_kv_heads": 32, "num_layers": 12}),
    ],
    ids=["qwen3-moe", "deepseek (MLA, no kv heads)", "multimodal text_config", "hybrid layer list"],
)
def test_the_shape_megatron_splits_is_read_from_each_familys_keys(config, shape):
    from miles_core.models.source import model_shape

    assert model_shape(config) == shape


@pytest.mark.parametrize(
    "arch, layout, refused",
    [
        ("deepseek_v3", {"tensor_parallel": 2, "expert_parallel": 1}, r"train.expert_parallel: MoE layers at tensor parallel > 1 need expert parallel > 1"),
        ("deepseek_v3", {"tensor_parallel": 2, "expert_parallel": 2}, None),
        ("qwen3_moe", {"tensor_parallel": 2, "expert_parallel": 1}, r"train.expert_parallel: MoE layers at tensor parallel > 1 need expert parallel > 1"),
        ("qwen3_moe", {"tensor_parallel": 2, "expert_parallel": 2}, None),
        ("deepseek_v3", {"tensor_parallel": 1, "expert_parallel": 2}, None),
    ],
)
def test_a_checkpoint_is_refused_in_a_layout_megatron_would_train_wrong(tmp_path, arch, layout, refused):
    """What rules.py refuses for the tiny models, admission refuses for a user's checkpoint (a real Qwen3-MoE at TP 2 without EP); DeepSeek-V3's
    multi-latent attention is admitted at TP 2."""
    model = ModelConfig(arch=arch, hidden_size=64, num_heads=4, num_kv_heads=4, intermediate_size=128, num_experts=4, moe_intermediate_size=32)
    directory = build_tiny_model(model, str(tmp_path))
    train = TrainConfig(backend="megatron", nproc_per_node=2, **layout)
    if refused is None:
        admit(directory, train, RolloutConfig())
    else:
        with pytest.raises(ConfigError, match=rf"{refused}.*config.json, train.backend: megatron"):
            admit(directory, train, RolloutConfig())
