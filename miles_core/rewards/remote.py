"""A reward model served over HTTP: POST {"response", "label", "metadata"} -> {"reward": number}.

Timeouts, retries with backoff, and one clear `RemoteRewardError` naming the URL and what went
wrong (down, slow, an HTTP error, garbage in the reply). The scorer (`loop.score`) turns that error
into the configured fallback reward, records it in the sample and counts it.
"""

from __future__ import annotations

import math
import time

import requests


class RemoteRewardError(RuntimeError):
    """The remote reward model could not score a response; the message names the URL and why."""


def _reward_of(reply: requests.Response, url: str) -> float:
    try:
        value = reply.json()["reward"]
    except (ValueError, KeyError, TypeError):
        raise RemoteRewardError(f"reward model at {url} returned garbage (expected JSON {{\"reward\": number}}): {reply.text[:200]!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RemoteRewardError(f"reward model at {url} returned a non-numeric reward: {value!r}")
    return float(value)


def remote_reward(url: str, response: str, label: str, metadata: dict, timeout_s: float = 10.0, retries: int = 2, backoff_s: float = 0.5) -> float:
    """The remote model's reward; retries connection errors, timeouts and 5xx replies `retries` times."""
    payload = {"response": response, "label": label, "metadata": metadata}
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            reply = requests.post(url, json=payload, timeout=timeout_s)
        except requests.ConnectionError as err:
            last = f"is down or unreachable ({type(err).__name__})"
            continue
        except requests.Timeout:
            last = f"did not answer within {timeout_s}s"
            continue
        if reply.status_code >= 500:
            last = f"failed with HTTP {reply.status_code}"
            continue
        if reply.status_code != 200:
            raise RemoteRewardError(f"reward model at {url} rejected the request with HTTP {reply.status_code}: {reply.text[:200]!r}")
        return _reward_of(reply, url)
    raise RemoteRewardError(f"reward model at {url} {last} after {retries + 1} attempts")
