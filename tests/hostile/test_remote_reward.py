"""The remote reward client against misbehaving servers on 127.0.0.1 (real sockets, nothing mocked).

Each server is a raw TCP listener that misbehaves in one way; each handler loop is bounded (it
stops when the test stops it, or after 10 s), so every test ends by itself. Times asserted are
the configured deadline plus slack for thread start-up, never a sleep used as synchronisation.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import replace

import pytest

from miles_core.config import ConfigError, RewardConfig
from miles_core.rewards import hub
from miles_core.rewards.remote import (
    RemotePolicy,
    RemoteRewardError,
    RemoteRewardUnavailable,
    remote_reward,
    remote_rewards,
)

SLACK_S = 1.0


def _reply(body: bytes, status: str = "200 OK") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body


def _hang(conn, stop):
    stop.wait(10)


def _trickle(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{")
    while not stop.wait(0.05):
        conn.sendall(b" ")


def _trickle_headers(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    while not stop.wait(0.05):
        conn.sendall(b"X")


def _huge(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10000000000\r\n\r\n")
    while not stop.is_set():
        conn.sendall(b"0" * 65536)


def _chunked_endless(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(100000):  # about 6.5 GB if nobody stops reading
        if stop.is_set():
            return
        conn.sendall(b"10000\r\n" + b"0" * 65536 + b"\r\n")


def _drop(conn, stop):
    conn.close()


def _fixed(body: bytes, status: str = "200 OK"):
    def handler(conn, stop):
        conn.sendall(_reply(body, status))

    return handler


class _Replying:
    """A connection whose first send calls `done` first (the server's count of connections awaiting a reply)."""

    def __init__(self, conn, done):
        self.conn, self.done = conn, done

    def sendall(self, data: bytes) -> None:
        self.done()
        self.conn.sendall(data)

    def __getattr__(self, name):
        return getattr(self.conn, name)


class Server:
    """A listener on 127.0.0.1 running `handler(conn, stop)` per connection; counts connections
    and the most open at once that await their reply (a client limited to N requests in flight may
    connect again as soon as a reply arrives, before this side has closed the answered connection)."""

    def __init__(self, handler, accept: bool = True):
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/score"
        self.handler, self.stop, self.lock = handler, threading.Event(), threading.Lock()
        self.connections = self.open = self.most_open = 0
        self.thread = threading.Thread(target=self._serve if accept else self.stop.wait, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn):
        with self.lock:
            self.connections += 1
            self.open += 1
            self.most_open = max(self.most_open, self.open)
        replied = threading.Event()

        def done():  # a connection counts as open until its reply starts: the client may reuse its slot from then on
            with self.lock:
                if not replied.is_set():
                    replied.set()
                    self.open -= 1

        try:
            conn.settimeout(1.0)
            conn.recv(65536)  # the request (small)
            self.handler(_Replying(conn, done), self.stop)
        except OSError:
            pass
        finally:
            done()
            conn.close()

    def close(self):
        self.stop.set()
        self.thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def serve():
    servers = []

    def start(handler, accept: bool = True) -> Server:
        servers.append(Server(handler, accept))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _timed(url: str, policy: RemotePolicy):
    started = time.monotonic()
    with pytest.raises(RemoteRewardError) as err:
        remote_reward(url, "408", "408", {}, policy)
    return str(err.value), time.monotonic() - started


@pytest.mark.parametrize(
    "handler,accept,reason",
    [
        (_hang, True, "did not answer within the deadline"),
        (_trickle, True, "did not answer within the deadline"),
        (_trickle_headers, True, "did not answer within the deadline|dropped"),
        (None, False, "did not answer within the deadline"),  # slow accept: the connection waits in the backlog
    ],
    ids=["hanging", "trickling body", "trickling headers", "slow accept"],
)
def test_a_slow_server_costs_the_deadline_in_all(serve, handler, accept, reason):
    """One deadline of 0.6 s covers every attempt (2 retries), however the server stalls."""
    server = serve(handler, accept)
    message, seconds = _timed(server.url, RemotePolicy(timeout_s=0.6, retries=2, backoff_s=0.05, max_consecutive_failures=100))
    assert seconds < 0.6 + SLACK_S
    assert server.url in message and any(r in message for r in reason.split("|")), message


@pytest.mark.parametrize("handler", [_huge, _chunked_endless], ids=["huge body", "endless chunked body"])
def test_a_huge_reply_is_refused_at_the_cap(serve, handler):
    server = serve(handler)
    message, seconds = _timed(server.url, RemotePolicy(timeout_s=5.0, max_response_bytes=4096, max_consecutive_failures=100))
    assert "remote_max_response_bytes=4096" in message
    assert seconds < 2.0  # refused at once, not read to the end


@pytest.mark.parametrize(
    "body,reason",
    [
        (b'{"reward": "1"}', "non-numeric reward: '1'"),
        (b'{"reward": true}', "non-numeric reward: True"),
        (b'{"reward": NaN}', "non-numeric reward: nan"),
        (b'{"reward": [1]}', "non-numeric reward: [1]"),
        (b"[1, 2]", "returned garbage"),
        (b'{"score": 1}', "returned garbage"),
        (b"\xff\xfe not json", "returned garbage"),
        (b"[" * 100000, "returned garbage"),  # nesting past the JSON parser's recursion limit
    ],
    ids=["string", "bool", "nan", "list", "array", "no reward key", "bytes", "deep nesting"],
)
def test_wrong_typed_replies_are_named(serve, body, reason):
    server = serve(_fixed(body))
    message, _ = _timed(server.url, RemotePolicy(timeout_s=2.0, max_response_bytes=200000, max_consecutive_failures=100))
    assert reason in message


def test_out_of_range_reward_is_an_error_or_a_logged_clamp(serve, caplog):
    server = serve(_fixed(b'{"reward": 5.0}'))
    message, _ = _timed(server.url, RemotePolicy(timeout_s=2.0, reward_range=(0.0, 1.0), max_consecutive_failures=100))
    assert "returned 5.0, outside [reward.min, reward.max] = [0.0, 1.0]" in message
    with caplog.at_level(logging.WARNING):
        assert remote_reward(server.url, "x", "y", {}, RemotePolicy(timeout_s=2.0, reward_range=(0.0, 1.0), out_of_range="clamp")) == 1.0
    assert "clamped into [0.0, 1.0]" in caplog.text


def test_dropped_connections_are_retried_a_bounded_number_of_times(serve):
    server = serve(_drop)
    message, _ = _timed(server.url, RemotePolicy(timeout_s=3.0, retries=2, backoff_s=0.01, max_consecutive_failures=100))
    assert "dropped the connection" in message and "retries=2" in message
    assert server.connections == 3  # 1 attempt + 2 retries


def test_circuit_breaker_opens_after_consecutive_failures(serve):
    """3 failed samples in a row open the breaker: the 4th call raises at once without a request."""
    server = serve(_fixed(b"{}", "500 Internal Server Error"))
    policy = RemotePolicy(timeout_s=2.0, retries=0, max_consecutive_failures=3, breaker_reset_s=60.0)
    for _ in range(3):
        with pytest.raises(RemoteRewardError, match="failed with HTTP 500"):
            remote_reward(server.url, "x", "y", {}, policy)
    with pytest.raises(RemoteRewardUnavailable, match="failed 3 times in a row .*the step fails"):
        remote_reward(server.url, "x", "y", {}, policy)
    assert server.connections == 3


def test_concurrency_limit_holds(serve):
    """16 samples at once against a server that answers after 0.2 s: never more than 2 connections open."""

    def slow_ok(conn, stop):
        stop.wait(0.2)
        conn.sendall(_reply(b'{"reward": 1}'))

    server = serve(slow_ok)
    policy = RemotePolicy(timeout_s=10.0, concurrency=2, max_consecutive_failures=100)
    results = remote_rewards(server.url, [("x", "y", {})] * 16, replace(policy, concurrency=8), batch_timeout_s=10.0)
    assert results == [1.0] * 16
    threads = [threading.Thread(target=remote_reward, args=(server.url, "x", "y", {}, policy)) for _ in range(8)]
    server.most_open = 0
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert server.most_open <= 2


def test_batch_deadline_bounds_a_whole_batch(serve):
    """8 samples against a hanging server with 2 at a time and a 1 s batch deadline: done in about 1 s, every sample an error."""
    server = serve(_hang)
    started = time.monotonic()
    results = remote_rewards(server.url, [("x", "y", {})] * 8, RemotePolicy(timeout_s=30.0, concurrency=2, max_consecutive_failures=100), batch_timeout_s=1.0)
    assert time.monotonic() - started < 1.0 + SLACK_S
    assert all(isinstance(r, RemoteRewardError) for r in results)


def test_a_prompt_selects_an_endpoint_by_name_and_never_supplies_an_address(serve):
    good, other = serve(_fixed(b'{"reward": 1}')), serve(_fixed(b'{"reward": 0}'))
    cfg = RewardConfig(remote_url=good.url, remote_endpoints=f"judge={other.url}")
    assert hub.remote("x", "y", {}, reward_cfg=cfg) == 1.0
    assert hub.remote("x", "y", {"reward_endpoint": "judge"}, reward_cfg=cfg) == 0.0
    with pytest.raises(ValueError, match="'elsewhere' is not one of reward.remote_endpoints \\(judge\\)"):
        hub.remote("x", "y", {"reward_endpoint": "elsewhere"}, reward_cfg=cfg)
    with pytest.raises(ValueError, match="metadata\\['reward_url'\\] is not accepted"):
        hub.remote("x", "y", {"reward_url": "http://203.0.113.9/steal"}, reward_cfg=cfg)
    with pytest.raises(ValueError, match="is not one of"):
        hub.remote("x", "y", {"reward_endpoint": other.url}, reward_cfg=cfg)  # an address is not a name


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"remote_endpoints": "judge"}, "reward.remote_endpoints"),
        ({"remote_endpoints": "judge=file:///etc/passwd"}, "reward.remote_endpoints"),
        ({"remote_endpoints": "a=http://x/1,a=http://x/2"}, "reward.remote_endpoints"),
        ({"remote_url": "ftp://x"}, "reward.remote_url"),
        ({"remote_timeout_s": float("inf")}, "reward.remote_timeout_s"),
        ({"remote_out_of_range": "ignore"}, "reward.remote_out_of_range"),
        ({"remote_max_response_bytes": 0}, "reward.remote_max_response_bytes"),
    ],
)
def test_bad_remote_settings_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        RewardConfig(**kwargs)


def test_catastrophic_format_regex_is_cut_off():
    """(a|aa)+b against 40 a's tries every split of the a's into 1s and 2s (Fibonacci(40), about 10**8
    ways) before failing; the time limit ends it in about 0.2 s."""
    cfg = RewardConfig(regex_timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(ValueError, match="took over reward.regex_timeout_s=0.2s"):
        hub.format_regex("a" * 40, "", {"format_pattern": "(a|aa)+b"}, reward_cfg=cfg)
    assert time.monotonic() - started < 0.2 + SLACK_S
    with pytest.raises(ValueError, match="over reward.regex_max_pattern_chars=1000"):
        hub.format_regex("a", "", {"format_pattern": "a" * 1001}, reward_cfg=cfg)
    with pytest.raises(ValueError, match="is not a regular expression"):
        hub.format_regex("a", "", {"format_pattern": "(("}, reward_cfg=cfg)


def test_odd_text_and_metadata_still_make_a_request(serve):
    """A lone surrogate, a NUL and a set in the metadata (not JSON) are encoded, not a crash."""
    server = serve(_fixed(b'{"reward": 0.5}'))
    assert remote_reward(server.url, "\ud800 \x00", "y", {"k": {1, 2}}, RemotePolicy(timeout_s=2.0)) == 0.5
