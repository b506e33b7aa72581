"""One recipe, sync and async: the same plug-points run with the same settings in both modes.

The recipe uses a multi-turn tool rollout, a remote reward model (a real HTTP server on loopback),
dynamic sampling and a custom rollout_fn (tests/integration/recording.py, which records how it is
called and runs the default). The sync step runs in this process (`step.run_step`, what the sync
tasks run stage by stage); the async phase runs on a real local Ray cluster, its rollout_fn in the
rollout actors. Nothing is mocked.
"""

import dataclasses
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from transformers import AutoTokenizer

from miles_core.async_buffer import draw_of, stream_position
from miles_core.async_loop import run_phase
from miles_core.config import load_recipe
from miles_core.data.problems import make_addition, write_jsonl
from miles_core.data.source import DataState, PromptSource, load_prompts
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.step import bind, run_step
from miles_core.train.backends import convert_checkpoint, load_trainer
from tests.conftest import REPO
from tests.integration.test_async_phase import spec_for

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.integration


class RewardModel(BaseHTTPRequestHandler):
    """Rewards a response by the parity of its length (so groups differ), and records every request."""

    requests: ClassVar[list[dict]] = []

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        RewardModel.requests.append(payload)
        body = json.dumps({"reward": float(len(payload["response"]) % 2)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def reward_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), RewardModel)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()


@pytest.fixture(scope="module")
def record_file(tmp_path_factory):
    return tmp_path_factory.mktemp("record") / "calls.jsonl"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, reward_url, record_file):
    overrides = {
        "rollout": {
            "generate_fn": "miles_core.rollout.multi_turn:generate",
            "rollout_fn": "tests.integration.recording:rollout",
            "dynamic_sampling": True,
            "over_sample": 1.5,
            "max_rounds": 3,
            "prompts_per_step": 4,
            "multi_turn": {"tools": "calc", "max_turns": 2, "max_response_tokens": 12},
        },
        "reward": {"fn": "miles_core.rewards.hub:remote", "remote_url": reward_url, "remote_retries": 0},
        "async_phase": {"prompts_per_lease": 2},
    }
    cfg = load_recipe(REPO / "recipes" / "smoke_async.yaml", overrides)
    root = tmp_path_factory.mktemp("parity")
    policy = build_tiny_model(cfg.model, str(root / "policy"))
    convert_checkpoint(cfg.train, cfg.algo, policy, root / "ckpt")
    train_rows, _ = make_addition(cfg.data)
    write_jsonl(train_rows, root / "train.jsonl")
    return cfg, load_prompts(root / "train.jsonl"), root


def calls(record_file, start: int) -> list[dict]:
    lines = record_file.read_text().splitlines()[start:] if record_file.exists() else []
    return [{k: v for k, v in json.loads(line).items() if k != "generated"} for line in lines]


def test_sync_and_async_run_the_same_functions_with_the_same_settings(setup, record_file, monkeypatch):
    cfg, prompts, root = setup
    monkeypatch.setenv("MILES_RECORD_FILE", str(record_file))
    fns = bind(rollout=cfg.rollout, reward=cfg.reward, algo=cfg.algo, hooks=cfg.hooks, evaluation=cfg.evaluation)
    RewardModel.requests = []
    samples, _, metrics = run_step(
        TorchEngine(str(root / "policy"), 0),
        PromptSource(prompts, cfg.data.seed, DataState()),
        AutoTokenizer.from_pretrained(root / "policy"),
        fns,
        load_trainer(cfg.train, str(root / "ckpt")),
        [],
        0,
    )
    sync_calls, sync_requests = calls(record_file, 0), list(RewardModel.requests)
    assert sync_calls and all("turns" in s.metadata for s in samples) and "rollout/dropped_groups" in metrics

    RewardModel.requests = []
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"MILES_RECORD_FILE": str(record_file)}})
    try:
        spec = dataclasses.replace(spec_for((cfg, prompts, root)), version=0, steps=1)
        result = run_phase(spec, str(root / "async-ckpt"))
    finally:
        ray.shutdown()
    async_calls, async_requests = calls(record_file, len(sync_calls)), list(RewardModel.requests)

    # one description per mode, and they are equal: the same functions with the same bound settings
    assert {json.dumps(c, sort_keys=True) for c in sync_calls} == {json.dumps(c, sort_keys=True) for c in async_calls}
    call = sync_calls[0]
    assert (
        call["generate_fn"]["fn"] == "miles_core.rollout.multi_turn:generate" and call["generate_fn"]["bound"]["rollout_cfg"]["multi_turn"]["tools"] == "calc"
    )
    assert call["reward_fn"]["fn"] == "miles_core.rewards.hub:remote" and call["reward_fn"]["bound"]["reward_cfg"]["remote_url"] == cfg.reward.remote_url
    assert call["settings"]["dynamic_sampling"] and call["dynamic_filter_fn"]["fn"] == "miles_core.algos.filters:nonzero_reward_std"
    # the remote model scored both modes' multi-turn samples, each against its own prompt's label
    labels = {p.label for p in prompts}
    for requests in (sync_requests, async_requests):
        assert requests and {r["label"] for r in requests} <= labels and len({r["label"] for r in requests}) > 1
    consumed = [s for batch in result.consumed for s in batch]
    assert len(consumed) == cfg.rollout.prompts_per_step * cfg.rollout.n_samples and all("turns" in s.metadata for s in consumed)
    assert all(len({s.reward for s in g}) > 1 for g in (consumed[i : i + cfg.rollout.n_samples] for i in range(0, len(consumed), cfg.rollout.n_samples)))
    # every drawn prompt ended once: trained on, filtered by dynamic sampling, or left in the buffer
    ended = Counter([draw_of(s) for s in consumed] + [draw_of(s) for g in result.buffer for s in g])
    ended.update({d: cfg.rollout.n_samples for d in result.filtered})
    drawn = range(stream_position(result.state, len(prompts)))
    assert ended == Counter({d: cfg.rollout.n_samples for d in drawn})
