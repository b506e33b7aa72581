"""The SGLang engine against a real SGLang 0.5.23 server on CPU (its own environment, `make sglang-env`).

One launched server is shared by every test of the module (its start-up takes half a minute here); the restart
test kills it and lets the engine start it again, and a smoke-size workflow run attaches to it. Nothing is mocked: the "never healthy" test
attaches to a real HTTP server that answers 404 on /health.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import requests
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from miles_core.config import SGLangConfig, TrainConfig
from miles_core.models.tiny import build_tokenizer
from miles_core.net import free_port
from miles_core.rollout.base import FINISH_LENGTH, FINISH_STOP, SamplingParams
from miles_core.rollout.engines import sglang_server
from miles_core.rollout.engines.sglang import SGLangEngine
from miles_core.rollout.engines.sglang_draft import write_draft
from miles_core.rollout.engines.sglang_server import SGLangError, SGLangServer, sglang_python
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.samples import Sample
from miles_core.train.base import pack
from miles_core.train.torch_backend import TorchTrainer

pytestmark = pytest.mark.integration

EOS = 2  # <|im_end|> of the project's tokenizer, the models' EOS id below
PROMPTS = [[1, 40, 41, 42], [1, 50, 51, 52, 53, 54, 55], [1, 60], [1, 70, 71, 72, 73]]
STOP_IDS = (EOS, *range(100, 130))  # ~10% of the vocabulary: some responses stop, some run to length
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=12, stop_token_ids=(EOS,))
LOGPROB_TOLERANCE = 1e-4  # fp32 on both sides; SGLang's torch_native attention vs HF eager differ ~1e-6


def sglang_env_python() -> str:
    """The SGLang environment's python; a missing environment fails the test (never skips it)."""
    try:
        return sglang_python(SGLangConfig())
    except SGLangError as err:
        pytest.fail(f"{err}. The SGLang tests need that environment: run `make sglang-env` (about 6 minutes, 11 GB, once)")


def build_policy(path: Path, seed: int) -> str:
    """A tiny Qwen2 HF directory with peaked logits (greedy choices are not near-ties)."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.2,
        eos_token_id=EOS,
        bos_token_id=0,
        pad_token_id=0,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-policies")
    return [build_policy(root / f"v{seed}", seed) for seed in range(3)]


@pytest.fixture(scope="module")
def engine(policies):
    sglang_env_python()
    engine = SGLangEngine(SGLangConfig(startup_timeout_s=600, max_batch_sequences=8, max_concurrency=2), policies[0], version=0)
    yield engine
    engine.close()


def greedy_tokens(out) -> list[list[int]]:
    return [gens[0].tokens for gens in out]


def test_generate_shapes_stop_tokens_and_versions(engine):
    engine.load_weights(engine.policy_dir, 0)
    out = engine.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=12, stop_token_ids=STOP_IDS, seed=1))
    assert [len(gens) for gens in out] == [3] * len(PROMPTS)
    reasons = set()
    for g in (g for gens in out for g in gens):
        reasons.add(g.finish_reason)
        assert len(g.tokens) == len(g.logprobs) >= 1
        assert all(lp <= 0.0 for lp in g.logprobs)
        assert not set(g.tokens[:-1]) & set(STOP_IDS), "nothing may follow a stop token"
        assert (g.finish_reason == FINISH_STOP) == (g.tokens[-1] in STOP_IDS)
        assert g.finish_reason == FINISH_STOP or len(g.tokens) == 12
        assert g.weight_version == 0
    assert reasons == {FINISH_STOP, FINISH_LENGTH}


def trainer_logprob_gap(policy_dir: str, prompts: list, out: list, temperature: float, pad_id: int) -> tuple[float, dict]:
    """The largest |engine - TorchTrainer| log-prob over the response tokens of `out` (the engine's generate output for
    `prompts`), the trainer on the weights of `policy_dir` replaying the engine's routing where it recorded any, and the
    trainer's routing metrics."""
    samples = [
        Sample(
            prompt_id=str(p),
            index=i,
            prompt_tokens=prompts[p],
            response_tokens=g.tokens,
            rollout_logprobs=g.logprobs,
            loss_mask=[1] * len(g.tokens),
            finish_reason=g.finish_reason,
            weight_version=g.weight_version,
            label="",
            routed_experts=g.routed_experts,
        )
        for p, gens in enumerate(out)
        for i, g in enumerate(gens)
    ]
    batch = pack(samples, pad_id=pad_id)
    trainer = TorchTrainer.from_hf(policy_dir, TrainConfig())
    recomputed = trainer.logprobs(batch, temperature)  # [B, T]
    return ((recomputed - batch.rollout_logprobs).abs() * batch.response_mask).max().item(), trainer.routing_metrics()


def test_logprobs_match_trainer_recompute(engine, policies):
    """SGLang's log-probs of its own samples equal TorchTrainer.logprobs on the same weights."""
    engine.load_weights(policies[0], 0)
    temperature = 0.7
    out = engine.generate(PROMPTS, SamplingParams(n=4, temperature=temperature, max_new_tokens=10, stop_token_ids=(EOS,), seed=2))
    gap, _ = trainer_logprob_gap(policies[0], PROMPTS, out, temperature, pad_id=0)
    assert gap < LOGPROB_TOLERANCE, f"max |SGLang - trainer| log-prob gap {gap:.2e}"


def test_greedy_equals_torch_engine_after_disk_update(engine, policies):
    engine.load_weights(policies[1], 1)
    assert engine.last_update_metrics["rollout/weight_update_s"] > 0
    out = engine.generate(PROMPTS, GREEDY)
    assert greedy_tokens(out) == greedy_tokens(TorchEngine(policies[1], 1).generate(PROMPTS, GREEDY))
    assert greedy_tokens(out) != greedy_tokens(TorchEngine(policies[0], 0).generate(PROMPTS, GREEDY)), "the update changed nothing"
    assert {gens[0].weight_version for gens in out} == {1}


def test_greedy_equals_torch_engine_after_distributed_updates(engine, policies):
    """A second engine attaches by URL with weight_sync=distributed and publishes over gloo;
    then a trainer's in-memory tensors go the same way."""
    cfg = dataclasses.replace(engine.cfg, urls=engine.servers[0].url, weight_sync="distributed")
    attached = SGLangEngine(cfg, policies[2], version=2)  # publishes v2 from its directory over the group
    try:
        assert greedy_tokens(attached.generate(PROMPTS, GREEDY)) == greedy_tokens(TorchEngine(policies[2], 2).generate(PROMPTS, GREEDY))
        trainer = TorchTrainer.from_hf(policies[1], TrainConfig())
        attached.update_weights_from_tensors(trainer.model.state_dict().items(), version=3)
        out = attached.generate(PROMPTS, GREEDY)
        assert greedy_tokens(out) == greedy_tokens(TorchEngine(policies[1], 3).generate(PROMPTS, GREEDY))
        assert {gens[0].weight_version for gens in out} == {3}
    finally:
        attached.close()  # closes its weight-update group; the attached server belongs to the module's engine
    engine.weight_version = None  # the shared server now holds v3: make the next load_weights publish


def started_stream(server, payload: dict):
    """The event payloads of a streaming /generate, returned once its first token has arrived."""
    response = requests.post(f"{server.url}/generate", json={**payload, "stream": True}, stream=True, timeout=(10, 120))
    chunks = (line[len(b"data: ") :].decode() for line in response.iter_lines() if line.startswith(b"data: "))
    next(chunks)
    return chunks


def test_a_draft_model_update_leaves_the_served_policy_as_it_was(engine, policies, tmp_path):
    """A speculative engine publishes each version twice, the policy then its draft model (engines/sglang_draft.py), from
    disk into target and draft alike: the target must skip every name of the draft's directory."""
    engine.load_weights(policies[0], 0)
    before = greedy_tokens(engine.generate(PROMPTS, GREEDY))
    draft = write_draft(policies[1], tmp_path / "draft")
    for server in engine.servers:
        server.post("/begin_weight_update")
        server.post("/update_weights_from_disk", {"model_path": str(draft), "flush_cache": False})
        server.post("/end_weight_update")
        server.post("/flush_cache")
    assert greedy_tokens(engine.generate(PROMPTS, GREEDY)) == before


def test_pause_abort_and_update_during_generation(engine, policies):
    """abort returns in-flight requests early; paused servers hold new work until continue; a
    generation running across a weight update comes back whole, each response from one version."""
    engine.load_weights(policies[0], 0)
    server = engine.servers[0]
    long_request = {"input_ids": PROMPTS[0], "return_logprob": True, "sampling_params": {"temperature": 1.0, "max_new_tokens": 400, "ignore_eos": True}}
    chunks = started_stream(server, long_request)  # the request is running: its first chunk arrived
    engine.pause("abort")
    last = json.loads([c for c in chunks if c != "[DONE]"][-1])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 400
    answer = {}
    held = threading.Thread(target=lambda: answer.update(generated=engine.generate(PROMPTS[:1], GREEDY)))
    held.start()
    held.join(timeout=5)
    assert held.is_alive(), "a paused server must not generate"
    engine.resume()
    held.join(timeout=120)
    assert not held.is_alive() and answer["generated"][0][0].weight_version == 0

    long_params = SamplingParams(n=2, temperature=0.0, max_new_tokens=200, stop_token_ids=(EOS,))
    resubmitted = engine.resubmitted_sequences
    running = threading.Thread(target=lambda: answer.update(across=engine.generate(PROMPTS, long_params)))
    running.start()
    while not engine.in_flight:  # update as soon as the generation is on the server
        time.sleep(0.005)
    engine.load_weights(policies[1], 1)
    running.join(timeout=300)
    assert engine.resubmitted_sequences > resubmitted, "the update did not meet a running generation"
    expected = {v: greedy_tokens(TorchEngine(policies[v], v).generate(PROMPTS, long_params)) for v in (0, 1)}
    for p, gens in enumerate(answer["across"]):
        for g in gens:
            assert g.tokens == expected[g.weight_version][p], "a response mixes two weight versions"


def test_killed_server_is_restarted_and_rollout_completes(engine, policies):
    engine.load_weights(policies[1], 1)
    server = engine.servers[0]
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=30)
    out = engine.generate(PROMPTS, GREEDY)
    assert server.restarts == 1 and server.alive()
    assert greedy_tokens(out) == greedy_tokens(TorchEngine(policies[1], 1).generate(PROMPTS, GREEDY))
    assert {gens[0].weight_version for gens in out} == {1}


def test_a_port_bound_by_another_process_first_is_given_up_for_another(policies, monkeypatch, caplog):
    """The server binds its port only after its engine has started; one taken meanwhile leaves the process up with no
    HTTP server (it would never become healthy): the launch starts it again on another port."""
    sglang_env_python()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        first, second = taken.getsockname()[1], free_port()
        ports = iter([first, second])
        monkeypatch.setattr(sglang_server, "free_port", lambda: next(ports))
        with caplog.at_level(logging.WARNING, logger=sglang_server.__name__):
            server = SGLangServer.launch(SGLangConfig(startup_timeout_s=600), policies[0], 0)
    try:
        assert server.url == f"http://127.0.0.1:{second}" and server.alive()
        assert requests.get(f"{server.url}/model_info", timeout=30).json()["model_path"] == policies[0]
        assert f"127.0.0.1:{first} was taken before the SGLang server bound it" in caplog.text
    finally:
        server.stop()


def test_server_that_never_becomes_healthy_fails_within_its_timeout():
    port = free_port()
    impostor = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        started = time.monotonic()
        with pytest.raises(SGLangError, match=r"not healthy within rollout.sglang.startup_timeout_s=4s"):
            SGLangServer.attach(f"http://127.0.0.1:{port}", SGLangConfig(startup_timeout_s=4))
        assert time.monotonic() - started < 30
    finally:
        impostor.terminate()
        impostor.wait(timeout=30)


def test_missing_environment_names_the_make_target(tmp_path):
    with pytest.raises(SGLangError, match="make sglang-env"):
        SGLangServer.launch(SGLangConfig(python=str(tmp_path / "nowhere" / "python")), str(tmp_path), 0)


@pytest.mark.flyte
@pytest.mark.timeout(1800)  # a whole workflow run: minutes when the machine is shared
def test_workflow_rolls_out_in_the_attached_server(engine, tmp_path, monkeypatch):
    """recipes/smoke_sglang.yaml through `pyflyte run`, attached by URL to this module's server
    (as tasks on a cluster reach theirs): every rollout batch comes from the version it was
    given, published over a gloo process group from the task's process."""
    from tests.conftest import run_workflow

    monkeypatch.setenv("MILES_SGLANG_ENV", str(Path(sglang_env_python()).parents[1]))  # the run's HOME is temporary
    root = tmp_path / "runs"
    out = run_workflow("recipes/smoke_sglang.yaml", root, tmp_path / "home", "iterations=2", f"rollout.sglang.urls={engine.servers[0].url}")
    engine.weight_version = None  # the run published its own versions into the shared server
    batches = sorted((root / "rollout").glob("*[0-9a-f].parquet"))
    assert [set(pd.read_parquet(b).weight_version) for b in batches] == [{1}, {2}]  # SFT publishes v1
    assert "rollout/weight_update_s" in out.stdout + out.stderr  # in the tasks' logged outputs
    assert requests.get(f"{engine.servers[0].url}/model_info", timeout=60).json()["weight_version"] == "3"
