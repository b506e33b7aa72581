"""The async phase on a real local Ray cluster (2 CPUs): it trains, bounds staleness, accounts for
every drawn prompt, survives a killed rollout actor, and fails clearly when a weight push times out."""

import dataclasses
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import torch

from miles_core.async_buffer import draw_of, stream_position
from miles_core.async_loop import ROLLOUT_ACTOR, AsyncPhaseError, PhaseSpec, run_phase
from miles_core.config import HealthConfig, PublishConfig, load_recipe
from miles_core.data.problems import make_addition, write_jsonl
from miles_core.data.source import DataState, PromptSource, load_prompts
from miles_core.models.tiny import build_tiny_model
from miles_core.rewards.math import integer_answer
from miles_core.train.sft import demonstrations, run_sft, sft_train_config
from miles_core.train.torch_backend import TorchTrainer
from miles_core.weights.publish import copy_tokenizer, publish
from tests.conftest import REPO

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """The smoke recipe's model after a short SFT (so groups have reward variance), as policy and checkpoint."""
    from transformers import AutoTokenizer

    cfg = load_recipe(REPO / "recipes" / "smoke_async.yaml", {"sft": {"steps": 80}})
    root = tmp_path_factory.mktemp("async")
    base = build_tiny_model(cfg.model, str(root / "base"))
    train_rows, _ = make_addition(cfg.data)
    write_jsonl(train_rows, root / "train.jsonl")
    prompts = load_prompts(root / "train.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(base)
    trainer = TorchTrainer.from_hf(base, sft_train_config(cfg.sft))
    run_sft(trainer, demonstrations(prompts, tokenizer), cfg.sft, tokenizer.pad_token_id)
    publish(trainer, base, root / "policy", "float32", version=1, parent_version=0)
    TorchTrainer.from_hf(str(root / "policy"), cfg.train).save(str(root / "ckpt"))
    copy_tokenizer(base, root / "ckpt")
    return cfg, prompts, root


def spec_for(start, **async_overrides) -> PhaseSpec:
    cfg, prompts, root = start
    return PhaseSpec(
        cfg=dataclasses.replace(cfg.async_phase, **async_overrides),
        rollout=cfg.rollout,
        reward=cfg.reward,
        algo=cfg.algo,
        train=cfg.train,
        hooks=cfg.hooks,
        health=cfg.health,
        publish=cfg.publish,
        source_fn=PromptSource,
        seed=cfg.data.seed,
        prompts=prompts,
        state=DataState(),
        waiting=[],
        ckpt_dir=str(root / "ckpt"),
        policy_dir=str(root / "policy"),
        version=1,
        reference_dir=str(root / "policy"),
        first_iteration=0,
        steps=3,
    )


def assert_every_draw_ends_once(spec: PhaseSpec, result) -> None:
    """Each prompt drawn in the phase is consumed, dropped or buffered: every one of its samples, exactly once."""
    ended = [f"{draw_of(s)}/{s.index}" for batch in result.consumed for s in batch]
    ended += result.dropped + [f"{draw_of(s)}/{s.index}" for g in result.buffer for s in g]
    ended += [f"{d}/{i}" for d in result.filtered for i in range(spec.rollout.n_samples)]  # dropped by dynamic sampling
    drawn = range(stream_position(spec.state, len(spec.prompts)), stream_position(result.state, len(spec.prompts)))
    assert Counter(ended) == Counter(f"{d}/{i}" for d in drawn for i in range(spec.rollout.n_samples))


def test_async_phase_trains_within_the_staleness_bound(cluster, start, tmp_path):
    spec = spec_for(start, update_weights_interval=1, max_staleness=1, partial_rollout=True, mask_stale_tokens=True)
    result = run_phase(spec, str(tmp_path / "ckpt"))
    assert len(result.consumed) == 3 and all(len(b) == spec.rollout.prompts_per_step * spec.rollout.n_samples for b in result.consumed)
    assert result.metrics["train/step"] == 3 * spec.train.mini_batches
    before = TorchTrainer.load(spec.ckpt_dir, spec.train).model.state_dict()
    after = TorchTrainer.load(str(tmp_path / "ckpt"), spec.train).model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the policy moved
    for batch in result.consumed:
        for s in batch:
            assert s.weight_version >= s.metadata["trainer_version"] - spec.cfg.max_staleness
            assert 1 <= s.weight_version <= s.metadata["trainer_version"]
    assert {s.metadata["trainer_version"] for s in result.consumed[-1]} == {3}
    assert max(s.weight_version for s in result.consumed[-1]) >= 2  # the pushed weights were used
    for key in (
        "async/samples_per_s",
        "async/tokens_per_s",
        "async/queue_depth_mean",
        "async/rollout_idle_s",
        "async/phase_staleness_mean",
        "time/async_startup_s",
    ):
        assert key in result.metrics
    assert all(
        {"async/weight_push_s", "async/trainer_idle_s", "async/queue_depth", "async/staleness_max", "train/loss", "reward/mean"} <= set(m) for m in result.steps
    )
    assert all(m["async/weight_push_s"] > 0 for m in result.steps[:-1])  # pushed after every step but the last
    assert_every_draw_ends_once(spec, result)


def test_async_phase_trains_the_megatron_backend(cluster, start, tmp_path):
    """The trainer actor trains megatron-core in a world of one (gloo) from a torch_dist checkpoint, pushes
    its weights (gathered, under HF names) to the torch engines, and publishes the result as HF weights."""
    import json

    from safetensors.torch import load_file

    from miles_core.train.backends import convert_checkpoint

    cfg, _, root = start
    train = dataclasses.replace(cfg.train, backend="megatron")
    ckpt = tmp_path / "megatron-start"
    # megatron's process group lives in the process that converts: a Ray worker, not this test process
    ray.get(ray.remote(convert_checkpoint).remote(train, cfg.algo, str(root / "policy"), ckpt))
    spec = dataclasses.replace(spec_for(start, update_weights_interval=1, max_staleness=0), train=train, ckpt_dir=str(ckpt), steps=2)
    result = run_phase(spec, str(tmp_path / "ckpt"), str(tmp_path / "policy"))
    state = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert state["backend"] == "megatron" and state["step"] == 2 * train.mini_batches == result.metrics["train/step"]
    assert (tmp_path / "ckpt" / "model" / "metadata.json").exists()  # torch_dist format
    assert {s.weight_version for s in result.consumed[-1]} == {2}  # staleness 0: generated by the pushed megatron weights
    before, after = load_file(root / "policy" / "model.safetensors"), load_file(tmp_path / "policy" / "model.safetensors")
    common = set(before) & set(after)
    assert common and any(not torch.equal(before[k], after[k]) for k in common)  # the published policy moved
    assert json.loads((tmp_path / "policy" / "policy.json").read_text())["version"] == spec.version + spec.steps
    assert_every_draw_ends_once(spec, result)


def test_a_killed_rollout_actor_is_restarted_and_nothing_is_lost(cluster, start, tmp_path):
    spec = spec_for(start, update_weights_interval=2, max_staleness=3, stale_policy="regenerate")
    killed = threading.Event()

    def kill_first_actor():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed.is_set():
            try:
                actor = ray.get_actor(ROLLOUT_ACTOR.format(0))
            except ValueError:  # not created yet
                time.sleep(0.2)
                continue
            ray.get(actor.__ray_ready__.remote())  # constructed: registered with the buffer, about to generate
            ray.kill(actor, no_restart=False)  # the process dies mid-phase, Ray restarts it
            killed.set()

    killer = threading.Thread(target=kill_first_actor, daemon=True)
    killer.start()
    result = run_phase(spec, str(tmp_path / "ckpt"))
    killer.join()
    assert killed.is_set()
    assert result.metrics["async/actor_restarts"] >= 1, result.metrics
    assert len(result.consumed) == spec.steps
    assert_every_draw_ends_once(spec, result)


def test_a_weight_push_that_times_out_fails_the_phase_clearly(cluster, start, tmp_path):
    """A push timeout far below any acknowledgement: one or both actors miss it (which one answers first is a race), and
    the phase fails with the push named, not at a later deadline (take_timeout_s) or a hang."""
    spec = spec_for(start, push_timeout_s=1e-4)
    with pytest.raises(AsyncPhaseError, match=r"weight push of version 2 not acknowledged by [12] of 2 rollout actors within async_phase\.push_timeout_s"):
        run_phase(spec, str(tmp_path / "ckpt"))


def test_a_tripped_health_gate_stops_the_trainer_actor_before_it_saves(cluster, start, tmp_path):
    """The async trainer runs the same gates as the sync train task (step.train_step): its first step trips
    health.max_grad_norm, the phase fails naming the gate, and no checkpoint is written."""
    spec = dataclasses.replace(spec_for(start), health=HealthConfig(max_grad_norm=1e-9))
    with pytest.raises(Exception, match=r"health gate grad_norm tripped at [0-9.]+ \(health.max_grad_norm is 1e-09\)"):
        run_phase(spec, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


def test_fp8_pushes_and_publishes_quantized_weights(cluster, start, tmp_path):
    """publish.quantization=fp8: every push hands the actors FP8 numbers (quantized and restored) and the phase's
    policy is published in FP8 blocks. The first step trains on the unquantized starting policy's samples (mismatch
    about 0); with max_staleness 0 the later steps train only on samples of pushed FP8 weights."""
    spec = dataclasses.replace(spec_for(start, update_weights_interval=1, max_staleness=0), publish=PublishConfig(quantization="fp8"))
    result = run_phase(spec, str(tmp_path / "ckpt"), str(tmp_path / "policy"))
    assert json.loads((tmp_path / "policy" / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    first, *later = [m["mismatch/abs_logprob_diff"] for m in result.steps]
    assert later and all(m > 10 * first for m in later)


def test_int4_qat_trains_on_the_pushed_int4_weights(cluster, start, tmp_path):
    """publish.quantization=int4 with train.qat=int4 (groups of 32): every push hands the actors the int4 numbers the
    trainer's forward computes with, and the phase's policy is published packed. The first step trains on the
    unquantized starting policy's samples (the int4 rounding shows); with max_staleness 0 the later steps train only on
    samples of pushed int4 weights, and their mismatch is rounding only."""
    spec = spec_for(start, update_weights_interval=1, max_staleness=0)
    qat, int4 = dataclasses.replace(spec.train, qat="int4", qat_group_size=32), PublishConfig(quantization="int4", group_size=32)
    spec = dataclasses.replace(spec, train=qat, publish=int4)
    result = run_phase(spec, str(tmp_path / "ckpt"), str(tmp_path / "policy"))
    config = json.loads((tmp_path / "policy" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["config_groups"]["group_0"]["weights"]["group_size"] == 32
    first, *later = [m["mismatch/abs_logprob_diff"] for m in result.steps]
    assert first > 1e-3 and later and all(m < 1e-5 for m in later)


class LeaseOverlapRewardModel(BaseHTTPRequestHandler):
    """A reward model on loopback that holds the requests of a phase's first lease until requests of a later lease come
    in (at most 5 s, within reward.remote_timeout_s), and records for each held one whether they did."""

    leases_per_draw: ClassVar[int] = 1
    leases: ClassVar[set[int]] = set()
    later_lease_in = threading.Event()
    released_by_later_lease: ClassVar[list[bool]] = []

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        lease = payload["metadata"]["draw"] // self.leases_per_draw
        self.leases.add(lease)
        if len(self.leases) > 1:
            self.later_lease_in.set()
        if lease == 0:
            self.released_by_later_lease.append(self.later_lease_in.wait(5))
        body = json.dumps({"reward": integer_answer(payload["response"], payload["label"], payload["metadata"])}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_rollout_actor_generates_its_next_lease_while_the_last_is_scored(cluster, start, tmp_path):
    """One rollout actor and a remote reward model that answers the first lease only once a later lease's requests
    arrive: the actor scores a lease in a thread and goes on generating, so the first lease is released by the second,
    and every draw still ends once."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), LeaseOverlapRewardModel)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    spec = spec_for(start, rollout_workers=1)
    LeaseOverlapRewardModel.leases_per_draw = spec.cfg.prompts_per_lease  # one actor: lease k holds draws k*n ... k*n+n-1
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    remote = dataclasses.replace(spec.reward, fn="miles_core.rewards.hub:remote", remote_url=url, remote_concurrency=64)  # room for both leases
    spec = dataclasses.replace(spec, steps=2, reward=remote)
    try:
        result = run_phase(spec, str(tmp_path / "ckpt"))
    finally:
        server.shutdown()
    held = LeaseOverlapRewardModel.released_by_later_lease
    assert held and all(held)  # one per distinct request of the first lease
    assert all(not s.metadata.get("reward_error") for batch in result.consumed for s in batch)
    assert result.metrics["async/rollout_score_s"] > 0
    assert_every_draw_ends_once(spec, result)


def test_an_async_phase_rolls_out_in_a_real_sglang_server(cluster, start, tmp_path):
    """The rollout actor's engine is SGLang (CPU), attached by URL to a server launched here (one actor:
    a server takes weights from one client); every
    weight push is broadcast into it over a gloo process group, and its samples carry the versions
    the server reports."""
    from miles_core.config import SGLangConfig
    from miles_core.rollout.engines.sglang import SGLangEngine
    from tests.integration.test_sglang import sglang_env_python

    sglang_env_python()
    cfg, _, root = start
    server = SGLangEngine(SGLangConfig(startup_timeout_s=600), str(root / "policy"), version=1)
    try:
        rollout = dataclasses.replace(cfg.rollout, engine="sglang", sglang=SGLangConfig(urls=server.servers[0].url, weight_sync="distributed"))
        spec = dataclasses.replace(spec_for(start, update_weights_interval=1, max_staleness=1, rollout_workers=1), rollout=rollout)
        result = run_phase(spec, str(tmp_path / "ckpt"))
    finally:
        server.close()
    assert len(result.consumed) == spec.steps
    assert max(s.weight_version for s in result.consumed[-1]) >= 2  # generated by pushed weights
    assert all(m["async/weight_push_s"] > 0 for m in result.steps[:-1])
    assert_every_draw_ends_once(spec, result)
