"""The requests the SGLang engine sends to serve a LoRA policy unmerged (docs/lora.md): adapters loaded and unloaded by
version, each /generate naming the adapter, the launch arguments that enable LoRA.

The server here is a loopback HTTP server that records the requests and answers as SGLang 0.5.23 does, so the order and
content of every call can be read back; the real CPU server serving adapters is tests/integration/test_sglang_lora.py.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles_core.config import LoraConfig, ModelConfig, SGLangConfig, TrainConfig
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engines.sglang import SGLangEngine, lora_launch_args
from miles_core.rollout.engines.sglang_server import SGLangError
from miles_core.train.torch_backend import TorchTrainer
from miles_core.weights.publish import publish

TINY = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
LORA = TrainConfig(lora=LoraConfig(rank=4, alpha=8.0, target_modules="q_proj,v_proj"))


class Recorder(BaseHTTPRequestHandler):
    """Answers /health, the LoRA adapter calls and /generate (two tokens per sequence) as SGLang does; records each POST."""

    requests: list[tuple[str, dict]] = []

    def do_GET(self):
        self._answer({})

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append((self.path, payload))
        if self.path == "/generate":
            meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, 5, None], [-2.0, 6, None]], "weight_version": "0"}
            self._answer([{"output_ids": [5, 6], "meta_info": meta} for _ in payload["input_ids"]])
        else:
            self._answer({"success": True})

    def _answer(self, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    Recorder.requests = []
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """(base dir, adapter versions 1 and 2 published from one LoRA trainer)."""
    root = tmp_path_factory.mktemp("lora-sglang")
    base = build_tiny_model(TINY, str(root / "base"))
    trainer = TorchTrainer.from_hf(base, LORA)
    for version in (1, 2):
        publish(trainer, base, root / f"policy-{version}", "float32", version, version - 1, adapter=(LORA.lora, base))
    return base, str(root / "policy-1"), str(root / "policy-2")


def test_the_launch_enables_lora_with_the_adapters_rank_and_modules(adapters):
    _, first, _ = adapters
    lora = ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "q_proj", "v_proj"]
    assert lora_launch_args(first, "cuda") == lora
    assert lora_launch_args(first, "cpu") == [*lora, "--lora-backend", "torch_native"]


def test_each_version_is_loaded_by_name_named_by_every_generate_and_the_previous_unloaded(adapters, server):
    base, first, second = adapters
    engine = SGLangEngine(SGLangConfig(urls=server), first, 1, base_dir=base)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=2)
    generations = engine.generate([[1, 5], [1, 6, 7]], params)
    engine.load_weights(second, 2)
    later = engine.generate([[1, 5]], params)
    engine.close()
    calls = [path for path, _ in Recorder.requests]
    assert calls == ["/load_lora_adapter", "/generate", "/load_lora_adapter", "/unload_lora_adapter", "/generate"]
    loads = [payload for path, payload in Recorder.requests if path.endswith("_lora_adapter")]
    assert loads == [{"lora_name": "v1", "lora_path": first}, {"lora_name": "v2", "lora_path": second}, {"lora_name": "v1"}]
    generates = [payload for path, payload in Recorder.requests if path == "/generate"]
    assert generates[0]["lora_path"] == ["v1"] * 4 and generates[1]["lora_path"] == ["v2"] * 2
    assert {g.weight_version for gs in generations for g in gs} == {1} and {g.weight_version for gs in later for g in gs} == {2}


def test_an_adapter_without_its_base_or_full_weights_after_adapters_are_refused(adapters, server):
    base, first, _ = adapters
    with pytest.raises(SGLangError, match="the servers need its base model's directory"):
        SGLangEngine(SGLangConfig(urls=server), first, 1)
    engine = SGLangEngine(SGLangConfig(urls=server), first, 1, base_dir=base)
    with pytest.raises(SGLangError, match="full weights, and these servers were launched for a LoRA policy"):
        engine.load_weights(base, 2)
    engine.close()
