"""The reward hub on a held-out set of answer formats, per-sample reward types, the remote reward
model against a real HTTP server on 127.0.0.1 (up, down, slow, garbage, flaky, hanging), and the
score stage (`step.score`): its fallback when a reward fails, a remote batch within
reward.remote_batch_timeout_s, an open circuit breaker failing the step, out-of-range rewards."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles_core.config import RewardConfig
from miles_core.models.tiny import build_tokenizer
from miles_core.net import free_port
from miles_core.rewards import hub
from miles_core.rewards.math import last_boxed
from miles_core.rewards.remote import RemotePolicy, RemoteRewardError, RemoteRewardUnavailable, remote_reward
from miles_core.samples import Sample
from miles_core.step import bind, score

# (response, label, expected math_answer): formats not used to write the hub, each checked by math-verify.
HELD_OUT_MATH = [
    ("The answer is \\boxed{408}.", "408", 1.0),
    ("408", "408", 1.0),
    ("So we get $\\frac{1}{2}$.", "\\frac{1}{2}", 1.0),
    ("0.5", "1/2", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("x = 2", "2", 1.0),
    ("\\boxed{408.0}", "408", 1.0),
    ("\\boxed{409}", "408", 0.0),
    ("I do not know", "408", 0.0),
    ("", "408", 0.0),
    ("<tool>python\nprint(12*34)\n</tool>\ntool\n408\nassistant\n407", "408", 0.0),  # the tool's 408 is not the answer
    ("<tool>python\nprint(12*34)\n</tool>\ntool\n408\nassistant\n408", "408", 1.0),
]


@pytest.mark.parametrize("response,label,expected", HELD_OUT_MATH)
def test_math_answer_on_held_out_formats(response, label, expected):
    assert hub.math_answer(response, label, {}) == expected


def test_boxed_extraction_and_boxed_math():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("no box") is None
    assert hub.boxed_math("\\boxed{\\frac{2}{4}}", "1/2", {}) == 1.0
    assert hub.boxed_math("1/2", "1/2", {}) == 0.0  # right, but not boxed


def test_exact_match_and_f1():
    assert hub.exact_match("The  Eiffel Tower!", "eiffel tower", {}) == 1.0
    assert hub.exact_match("Eiffel", "eiffel tower", {}) == 0.0
    assert hub.f1("the eiffel tower in paris", "Eiffel Tower", {}) == pytest.approx(2 * (2 / 4) * 1.0 / (2 / 4 + 1.0))
    assert hub.f1("", "", {}) == 1.0 and hub.f1("x", "", {}) == 0.0 and hub.f1("louvre", "eiffel tower", {}) == 0.0


def test_format_rewards():
    assert hub.format_boxed("so \\boxed{3}", "", {}) == 1.0
    assert hub.format_boxed("\\boxed{3} or \\boxed{4}", "", {}) == 0.0
    assert hub.format_regex("Answer: 42", "", {"format_pattern": r"Answer: \d+"}) == 1.0
    with pytest.raises(TypeError, match="format_pattern"):
        hub.format_regex("x", "", {})


def test_reward_type_is_chosen_per_sample():
    assert hub.by_metadata("the eiffel tower", "Eiffel Tower", {"reward_type": "exact"}) == 1.0
    assert hub.by_metadata("\\boxed{408}", "408", {}) == 1.0  # default type: math
    assert hub.by_metadata("408 apples", "408", {"reward_type": "integer"}) == 1.0
    with pytest.raises(ValueError, match="'nonsense' is not a reward type"):
        hub.by_metadata("x", "y", {"reward_type": "nonsense"})


RELEASE = threading.Event()  # a hanging reward model returns once the test lets it


class _Handler(BaseHTTPRequestHandler):
    mode = "ok"
    requests = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests += 1
        if self.mode == "slow":
            time.sleep(1.0)
        if self.mode == "hang":
            RELEASE.wait()  # until the test ends: the client gave up long before, nothing to answer
            return
        if self.mode == "flaky" and type(self).requests == 1:
            return self._reply(503, b"busy")
        if self.mode == "garbage":
            return self._reply(200, b"<html>not json</html>")
        self._reply(200, json.dumps({"reward": float(body["response"] == body["label"])}).encode())

    def _reply(self, status, data):
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def reward_server():
    """A real HTTP reward model on 127.0.0.1; set `_Handler.mode` to make it slow, flaky, garbage or hang."""
    _Handler.mode, _Handler.requests = "ok", 0
    RELEASE.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    RELEASE.set()
    server.shutdown()
    server.server_close()


def test_remote_reward_up(reward_server):
    cfg = RewardConfig(remote_url=reward_server)
    assert hub.by_metadata("prefix\nassistant\n408", "408", {"reward_type": "remote"}, reward_cfg=cfg) == 1.0
    assert hub.remote("407", "408", {}, reward_cfg=cfg) == 0.0


def test_remote_reward_down_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}/score"
    with pytest.raises(RemoteRewardError, match=f"reward model at {url} is down or dropped the connection .*retries=1"):
        remote_reward(url, "408", "408", {}, RemotePolicy(timeout_s=1.0, retries=1, backoff_s=0.01))


def test_remote_reward_slow_times_out(reward_server):
    _Handler.mode = "slow"
    with pytest.raises(RemoteRewardError, match="did not answer within the deadline .*remote_timeout_s=0.2s"):
        remote_reward(reward_server, "408", "408", {}, RemotePolicy(timeout_s=0.2, retries=0))


def test_remote_reward_garbage_is_named(reward_server):
    _Handler.mode = "garbage"
    with pytest.raises(RemoteRewardError, match="returned garbage .*not json"):
        remote_reward(reward_server, "408", "408", {})


def test_remote_reward_retries_a_server_error(reward_server):
    _Handler.mode = "flaky"
    assert remote_reward(reward_server, "408", "408", {}, RemotePolicy(retries=1, backoff_s=0.01)) == 1.0
    assert _Handler.requests == 2


def test_failed_reward_scores_the_fallback_and_is_counted():
    """The scorer with the remote model down: every sample gets reward.fallback, the error is
    recorded in its metadata and counted; nothing raises."""
    tokenizer = build_tokenizer()
    cfg = RewardConfig(
        fn="miles_core.rewards.hub:by_metadata",
        min=-1.0,
        fallback=-0.5,
        remote_url=f"http://127.0.0.1:{free_port()}/score",
        remote_retries=0,
        remote_timeout_s=1.0,
    )
    samples = [
        Sample("p", i, [1], tokenizer.encode("408", add_special_tokens=False), [0.0] * 3, [1] * 3, "stop", 0, "408", {"reward_type": "remote"})
        for i in range(2)
    ]
    metrics = score(samples, bind(reward=cfg), tokenizer, group_size=2)
    assert [s.reward for s in samples] == [-0.5, -0.5] and metrics["reward/failures"] == 2.0
    assert "is down or dropped the connection" in samples[0].metadata["reward_error"]


def _samples(tokenizer, answers: list[str], label: str = "408", metadata: dict | None = None) -> list[Sample]:
    out = []
    for i, answer in enumerate(answers):
        tokens = tokenizer.encode(answer, add_special_tokens=False)
        out.append(Sample("p", i, [1], tokens, [0.0] * len(tokens), [1] * len(tokens), "stop", 0, label, dict(metadata or {})))
    return out


def test_remote_rewards_of_a_batch_are_fetched_once_each(reward_server):
    tokenizer = build_tokenizer()
    samples = _samples(tokenizer, ["408", "407", "408", "12"])
    metrics = score(samples, bind(reward=RewardConfig(fn="miles_core.rewards.hub:remote", remote_url=reward_server)), tokenizer, group_size=4)
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0] and metrics["reward/failures"] == 0.0
    assert _Handler.requests == 3  # the same request once


def test_a_batch_is_scored_within_the_batch_deadline(reward_server):
    """A reward model that never answers: each sample's own deadline (30 s) is cut to what is left of
    the batch's (reward.remote_batch_timeout_s), so the batch ends with every sample scored the fallback."""
    _Handler.mode = "hang"
    tokenizer = build_tokenizer()
    cfg = RewardConfig(
        fn="miles_core.rewards.hub:remote",
        remote_url=reward_server,
        remote_timeout_s=30.0,
        remote_batch_timeout_s=0.5,
        remote_retries=0,
        remote_concurrency=2,
        fallback=0.25,
    )
    samples = _samples(tokenizer, ["1", "2", "3", "4"])
    metrics = score(samples, bind(reward=cfg), tokenizer, group_size=4)
    assert [s.reward for s in samples] == [0.25] * 4 and metrics["reward/failures"] == 4.0
    assert any("reward.remote_batch_timeout_s=0.5s spent before this sample" in s.metadata["reward_error"] for s in samples)


@pytest.mark.parametrize("fn, metadata", [("miles_core.rewards.hub:remote", {}), ("miles_core.rewards.hub:by_metadata", {"reward_type": "remote"})])
def test_an_open_circuit_breaker_fails_the_step(fn, metadata):
    """The model is down: the first sample's failure opens the breaker (max 1 consecutive failure), and
    the next sample's RemoteRewardUnavailable fails the score stage instead of scoring the fallback."""
    tokenizer = build_tokenizer()
    cfg = RewardConfig(
        fn=fn,
        remote_url=f"http://127.0.0.1:{free_port()}/score",
        remote_retries=0,
        remote_timeout_s=1.0,
        remote_concurrency=1,
        remote_max_consecutive_failures=1,
    )
    with pytest.raises(RemoteRewardUnavailable, match="failed 1 times in a row"):
        score(_samples(tokenizer, ["1", "2"], metadata=metadata), bind(reward=cfg), tokenizer, group_size=2)


def overshoot(samples: list[Sample], group_size: int) -> None:
    """A reward.post_fn that pushes the first sample of each group past reward.max and the second below reward.min."""
    for group in (samples[i : i + group_size] for i in range(0, len(samples), group_size)):
        group[0].reward, group[1].reward = 3.0, -2.0


def test_rewards_out_of_range_are_clamped_counted_and_named(caplog):
    tokenizer = build_tokenizer()
    cfg = RewardConfig(fn="miles_core.rewards.hub:integer", post_fn="tests.unit.test_reward_hub:overshoot")
    samples = _samples(tokenizer, ["408", "407", "408"])
    with caplog.at_level(logging.WARNING, logger="miles_core.step"):
        metrics = score(samples, bind(reward=cfg), tokenizer, group_size=3)
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0] and metrics["reward/out_of_range"] == 2.0
    assert "p/0=3.0" in caplog.text and "p/1=-2.0" in caplog.text and "p/2" not in caplog.text


@pytest.mark.parametrize("name", sorted(hub.REWARDS) + ["by_metadata"])
def test_every_hub_reward_fits_the_reward_plugpoint(name):
    from miles_core.plugins import PLUGPOINTS, load_function

    load_function(f"miles_core.rewards.hub:{'by_metadata' if name == 'by_metadata' else hub.REWARDS[name].__name__}", "reward.fn", PLUGPOINTS["reward.fn"])
