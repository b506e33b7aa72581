"""SGLang settings in recipes, the engine factory's choice, and the weight buckets' byte layout."""

from __future__ import annotations

import pytest
import torch

from miles_core.config import ConfigError, RolloutConfig, SGLangConfig, load_recipe
from miles_core.rollout.engines import make_engine, weight_update_metrics
from miles_core.rollout.engines.sglang_server import launch_args
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.weights.sync import flatten_bucket, iter_buckets


def test_sglang_recipe_resolves_nested_settings():
    cfg = load_recipe("recipes/tiny_arith_sglang.yaml", {"rollout.sglang.num_servers": 2})
    assert cfg.rollout.engine == "sglang" and cfg.rollout.sglang.num_servers == 2
    assert cfg.rollout.sglang.weight_sync == "disk"
    assert load_recipe("recipes/smoke_sglang.yaml").rollout.sglang.weight_sync == "distributed"


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("rollout.engine", "vllm", "rollout.engine: unknown engine 'vllm' (available: torch, sglang)"),
        ("rollout.sglang.weight_sync", "nfs", "rollout.sglang.weight_sync: must be one of disk, distributed"),
        ("rollout.sglang.urls", "127.0.0.1:30000", "rollout.sglang.urls: not an http(s) URL"),
        ("rollout.sglang.startup_timeout_s", 0, "rollout.sglang.startup_timeout_s: must be > 0"),
        ("rollout.sglang.pause_mode", "stop", "rollout.sglang.pause_mode: must be one of abort, retract, in_place"),
        ("rollout.sglang.servers", 2, "rollout.sglang.servers: unknown key"),
        ("rollout.sglang.tensor_parallel", 0, "rollout.sglang.tensor_parallel: must be >= 1"),
        ("rollout.sglang.tensor_parallel", 2, "rollout.sglang.tensor_parallel: 2 GPUs per server need device: cuda"),
        ("rollout.memory_gb", -1, "rollout.memory_gb: must be >= 0"),
    ],
)
def test_bad_sglang_settings_fail_naming_file_and_key(key, value, message):
    with pytest.raises(ConfigError, match="tiny_arith_sglang.yaml: " + message.replace("(", r"\(").replace(")", r"\)")):
        load_recipe("recipes/tiny_arith_sglang.yaml", {key: value})


def test_each_server_of_a_pod_gets_gpus_of_its_own():
    cuda = SGLangConfig(device="cuda", num_servers=2, tensor_parallel=4)
    args = [launch_args(cuda, "/m", 30000, 0, slot) for slot in (0, 1)]
    assert [a[a.index("--tp-size") + 1] for a in args] == ["4", "4"]
    assert [a[a.index("--base-gpu-id") + 1] for a in args] == ["0", "4"]  # GPUs 0-3 and 4-7
    assert "--base-gpu-id" not in launch_args(SGLangConfig(), "/m", 30000, 0)  # a CPU server has no GPU to pick


@pytest.mark.parametrize(
    "rollout, gpus",
    [
        (RolloutConfig(engine="sglang", sglang=SGLangConfig(device="cuda", num_servers=2, tensor_parallel=4)), 8),
        (RolloutConfig(engine="sglang", sglang=SGLangConfig(device="cuda", num_servers=2, urls="http://h:1")), 0),  # attached: launched elsewhere
        (RolloutConfig(engine="torch", sglang=SGLangConfig(device="cuda", num_servers=2)), 0),  # the section is unused
        (RolloutConfig(engine="sglang"), 0),  # CPU servers
    ],
)
def test_the_rollout_pod_requests_the_gpus_of_the_servers_it_launches(rollout, gpus):
    assert rollout.gpus() == gpus


def test_factory_builds_the_torch_engine_by_default(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(
        Qwen2Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
    ).save_pretrained(tmp_path)
    engine = make_engine(RolloutConfig(), str(tmp_path), 3, max_batch_sequences=5)
    assert isinstance(engine, TorchEngine) and engine.weight_version == 3 and engine.max_batch_sequences == 5
    assert weight_update_metrics(engine) == {}


def test_buckets_keep_order_bound_size_and_round_trip():
    named = [
        ("a", torch.arange(6, dtype=torch.float32).view(2, 3)),
        ("b", torch.ones(3, dtype=torch.bfloat16)),
        ("c", torch.arange(5, dtype=torch.float32)),
        ("d", torch.zeros(100, dtype=torch.float32)),
    ]
    buckets = list(iter_buckets(named, bucket_bytes=64))
    assert [b.names for b in buckets] == [["a", "b"], ["c"], ["d"]]  # c would start misaligned after b's 6 bytes
    assert buckets[0].dtypes == ["float32", "bfloat16"] and buckets[0].shapes == [[2, 3], [3]]
    offset, rebuilt = 0, {}
    for bucket in buckets:  # what a receiver does with the bytes and the (name, dtype, shape) list
        offset = 0
        for name, dtype, shape in zip(bucket.names, bucket.dtypes, bucket.shapes):
            size = torch.Size(shape).numel() * getattr(torch, dtype).itemsize
            rebuilt[name] = bucket.flat[offset : offset + size].view(getattr(torch, dtype)).view(shape)
            offset += size
        assert offset == bucket.nbytes
    for name, tensor in named:
        assert torch.equal(rebuilt[name], tensor)
    with pytest.raises(ValueError, match="at least one tensor"):
        flatten_bucket([])
