"""A reward model served over HTTP: POST {"response", "label", "metadata"} -> {"reward": number}.

The server is a network peer that may be slow, broken or hostile; what one costs is bounded:

* a **total deadline** per sample (`reward.remote_timeout_s`, retries and back-off included): a
  watchdog shuts the socket down at the deadline, so a server that trickles bytes, hangs after
  its headers or accepts slowly cannot hold a read past it (a per-read socket timeout alone can
  be kept alive one byte at a time);
* a **total deadline per batch** (`remote_rewards`, `reward.remote_batch_timeout_s`): a sample
  started late gets only what is left of it;
* a **response-size cap** (`reward.remote_max_response_bytes`): the body is read up to the cap
  and the reply refused past it (a declared Content-Length over the cap is refused unread);
* **bounded retries** with exponential back-off (connection errors, drops, timeouts, 5xx), only
  while the deadline leaves room;
* a **concurrency limit** per endpoint (`reward.remote_concurrency` requests in flight);
* a **circuit breaker** per endpoint: after `reward.remote_max_consecutive_failures` failed samples
  in a row every call raises `RemoteRewardUnavailable` at once (until `reward.remote_breaker_reset_s`
  passes, then one trial request); it is meant to fail the step, not to score fallbacks;
* a reward outside `[reward.min, reward.max]` is an error (`reward.remote_out_of_range: error`),
  or, when the recipe says `clamp`, clamped with a logged warning: never silently.

Every failure is one `RemoteRewardError` naming the URL and what went wrong.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


class RemoteRewardError(RuntimeError):
    """The remote reward model could not score a response; the message names the URL and why."""


class RemoteRewardUnavailable(RemoteRewardError):
    """The endpoint's circuit breaker is open: too many consecutive failures. Fails the step."""


@dataclass(frozen=True)
class RemotePolicy:
    timeout_s: float = 10.0  # total per sample, retries included
    retries: int = 2
    backoff_s: float = 0.5
    max_response_bytes: int = 65536
    concurrency: int = 8
    max_consecutive_failures: int = 5
    breaker_reset_s: float = 30.0
    reward_range: tuple[float, float] = (-math.inf, math.inf)
    out_of_range: str = "error"  # error | clamp


@dataclass
class _Endpoint:
    """Per-URL state shared by every caller in the process: the concurrency gate and the breaker."""

    gate: threading.BoundedSemaphore
    lock: threading.Lock = field(default_factory=threading.Lock)
    failures: int = 0
    opened_at: float | None = None


_ENDPOINTS: dict[tuple[str, int], _Endpoint] = {}
_REGISTRY_LOCK = threading.Lock()


def _endpoint(url: str, concurrency: int) -> _Endpoint:
    with _REGISTRY_LOCK:
        return _ENDPOINTS.setdefault((url, concurrency), _Endpoint(threading.BoundedSemaphore(concurrency)))


class _Retryable(Exception):
    """One attempt failed in a way another attempt may not (down, dropped, slow, 5xx)."""


def _post(url: str, body: bytes, deadline: float, max_bytes: int) -> tuple[int, bytes]:
    """(status, body) of one POST; no read outlasts the deadline, no body grows past max_bytes."""
    parts = urlsplit(url)
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _Retryable("ran out of time")
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=remaining)
    watchdog = threading.Timer(remaining, _shut, (conn,))  # the socket is shut at the deadline, whatever is being read
    watchdog.start()
    try:
        conn.request("POST", parts.path or "/", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        declared = reply.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise RemoteRewardError(f"reply of {declared} bytes is over reward.remote_max_response_bytes={max_bytes}")
        data = reply.read(max_bytes + 1)
        if time.monotonic() >= deadline:  # the watchdog shut the socket: what was read may be cut short
            raise _Retryable("did not answer within the deadline")
        if len(data) > max_bytes:
            raise RemoteRewardError(f"reply is over reward.remote_max_response_bytes={max_bytes} (body cut off unread)")
        return reply.status, data
    except (OSError, http.client.HTTPException) as err:
        late = time.monotonic() >= deadline - 0.01
        raise _Retryable("did not answer within the deadline" if late else f"is down or dropped the connection ({type(err).__name__})") from None
    finally:
        watchdog.cancel()
        conn.close()


def _shut(conn: http.client.HTTPConnection) -> None:
    if conn.sock is not None:
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _reward_of(data: bytes, url: str, policy: RemotePolicy) -> float:
    try:
        value = json.loads(data)["reward"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise RemoteRewardError(f'reward model at {url} returned garbage (expected JSON {{"reward": number}}): {data[:200]!r}') from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RemoteRewardError(f"reward model at {url} returned a non-numeric reward: {value!r:.200}")
    low, high = policy.reward_range
    if not low <= value <= high:
        if policy.out_of_range != "clamp":
            raise RemoteRewardError(
                f"reward model at {url} returned {value}, outside [reward.min, reward.max] = [{low}, {high}] (reward.remote_out_of_range: error)"
            )
        log.warning("reward model at %s returned %s, clamped into [%s, %s] (reward.remote_out_of_range: clamp)", url, value, low, high)
        value = min(max(value, low), high)
    return float(value)


def _attempts(url: str, body: bytes, deadline: float, policy: RemotePolicy) -> float:
    last = "did not answer within the deadline"
    for attempt in range(policy.retries + 1):
        pause = policy.backoff_s * 2 ** (attempt - 1) if attempt else 0.0
        if time.monotonic() + pause >= deadline:
            break
        time.sleep(pause)
        try:
            status, data = _post(url, body, deadline, policy.max_response_bytes)
        except _Retryable as err:
            last = str(err)
            continue
        except RemoteRewardError as err:
            raise RemoteRewardError(f"reward model at {url}: {err}") from None
        if status >= 500:
            last = f"failed with HTTP {status}"
            continue
        if status != 200:
            raise RemoteRewardError(f"reward model at {url} rejected the request with HTTP {status}: {data[:200]!r}")
        return _reward_of(data, url, policy)
    raise RemoteRewardError(f"reward model at {url} {last} (attempts within reward.remote_timeout_s={policy.timeout_s}s, retries={policy.retries})")


def _check_breaker(url: str, state: _Endpoint, policy: RemotePolicy) -> None:
    with state.lock:
        if state.opened_at is None:
            return
        if time.monotonic() - state.opened_at < policy.breaker_reset_s:
            raise RemoteRewardUnavailable(
                f"reward model at {url} failed {state.failures} times in a row (reward.remote_max_consecutive_failures="
                f"{policy.max_consecutive_failures}): not calling it again for {policy.breaker_reset_s}s; the step fails"
            )
        state.opened_at = None  # half-open: this call is the trial


def _record(state: _Endpoint, ok: bool, policy: RemotePolicy) -> None:
    with state.lock:
        state.failures = 0 if ok else state.failures + 1
        if state.failures >= policy.max_consecutive_failures:
            state.opened_at = time.monotonic()


def remote_reward(url: str, response: str, label: str, metadata: dict, policy: RemotePolicy = RemotePolicy()) -> float:
    """The remote model's reward for one response, within policy.timeout_s in all."""
    deadline = time.monotonic() + policy.timeout_s
    state = _endpoint(url, policy.concurrency)
    _check_breaker(url, state, policy)
    body = json.dumps({"response": response, "label": label, "metadata": metadata}, default=str).encode()  # ASCII: lone surrogates are escaped
    if not state.gate.acquire(timeout=max(deadline - time.monotonic(), 0)):
        raise RemoteRewardError(f"reward model at {url}: no free slot among reward.remote_concurrency={policy.concurrency} within the deadline")
    try:
        reward = _attempts(url, body, deadline, policy)
    except RemoteRewardError:
        _record(state, False, policy)
        raise
    finally:
        state.gate.release()
    _record(state, True, policy)
    return reward


def remote_rewards(url: str, items: list[tuple[str, str, dict]], policy: RemotePolicy, batch_timeout_s: float) -> list[float | RemoteRewardError]:
    """Rewards of many (response, label, metadata), policy.concurrency at a time, all within
    batch_timeout_s: each sample's deadline is the earlier of its own and the batch's. A failed
    sample's entry is its RemoteRewardError; an open circuit breaker raises RemoteRewardUnavailable."""
    deadline = time.monotonic() + batch_timeout_s

    def one(item: tuple[str, str, dict]) -> float | RemoteRewardError:
        left = deadline - time.monotonic()
        if left <= 0:
            return RemoteRewardError(f"reward model at {url}: reward.remote_batch_timeout_s={batch_timeout_s}s spent before this sample")
        try:
            return remote_reward(url, *item, replace(policy, timeout_s=min(policy.timeout_s, left)))
        except RemoteRewardUnavailable:
            raise
        except RemoteRewardError as err:
            return err

    with ThreadPoolExecutor(policy.concurrency) as pool:
        return list(pool.map(one, items))
