"""reward: the reward function and its range, and the remote reward model's endpoints and limits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from miles_core.config.base import check as _check

OUT_OF_RANGE_POLICIES = ("error", "clamp")


def _is_http_url(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.hostname)


@dataclass(frozen=True)
class RewardConfig:
    fn: str = "miles_core.rewards.math:integer_answer"  # plug-point: fn(response, label, metadata)
    min: float = 0.0
    max: float = 1.0
    group_fn: str = "miles_core.rewards.base:each_sample"  # plug-point: group_fn(reward_fn, responses)
    post_fn: str = "miles_core.rewards.base:no_post_processing"  # plug-point: post_fn(samples, group_size)
    fallback: float = 0.0  # the reward of a sample whose reward function failed (clamped into [min, max])
    default_type: str = "math"  # rewards.hub:by_metadata's type when metadata has no reward_type
    remote_url: str = ""  # rewards.hub:remote's default reward model endpoint (POST); only the recipe names addresses
    remote_endpoints: str = ""  # "name=url,name2=url2": the endpoints a prompt's metadata["reward_endpoint"] may pick by name
    remote_timeout_s: float = 10.0  # total per sample, retries and back-off included
    remote_batch_timeout_s: float = 300.0  # total per batch (rewards.remote:remote_rewards)
    remote_retries: int = 2
    remote_backoff_s: float = 0.5  # first retry's pause, doubled each retry
    remote_max_response_bytes: int = 65536
    remote_concurrency: int = 8  # requests in flight per endpoint
    remote_max_consecutive_failures: int = 5  # then the circuit breaker opens: RemoteRewardUnavailable fails the step
    remote_breaker_reset_s: float = 30.0
    remote_out_of_range: str = "error"  # a remote reward outside [min, max]: error | clamp (logged)
    regex_timeout_s: float = 1.0  # format_regex's matching time limit per response
    regex_max_pattern_chars: int = 1000

    def __post_init__(self):
        _check(math.isfinite(self.min) and math.isfinite(self.max) and self.min < self.max, "reward.max", "must be finite and > reward.min")
        for key in ("remote_timeout_s", "remote_batch_timeout_s", "remote_breaker_reset_s", "regex_timeout_s"):
            value = getattr(self, key)
            _check(math.isfinite(value) and value > 0, f"reward.{key}", f"must be a finite number > 0, got {value}")
        _check(math.isfinite(self.remote_backoff_s) and self.remote_backoff_s >= 0, "reward.remote_backoff_s", "must be finite and >= 0")
        _check(self.remote_retries >= 0, "reward.remote_retries", "must be >= 0")
        for key in ("remote_max_response_bytes", "remote_concurrency", "remote_max_consecutive_failures", "regex_max_pattern_chars"):
            _check(getattr(self, key) > 0, f"reward.{key}", f"must be > 0, got {getattr(self, key)}")
        _check(
            self.remote_out_of_range in OUT_OF_RANGE_POLICIES,
            "reward.remote_out_of_range",
            f"must be one of {OUT_OF_RANGE_POLICIES}, got {self.remote_out_of_range!r}",
        )
        _check(not self.remote_url or _is_http_url(self.remote_url), "reward.remote_url", f"must be an http(s) URL, got {self.remote_url!r}")
        self.endpoints()  # checks reward.remote_endpoints

    def endpoints(self) -> dict[str, str]:
        """reward.remote_endpoints as {name: url}."""
        named = {}
        for entry in filter(None, (e.strip() for e in self.remote_endpoints.split(","))):
            name, sep, url = (part.strip() for part in entry.partition("="))
            _check(bool(sep and name), "reward.remote_endpoints", f"entry {entry!r} is not name=url")
            _check(_is_http_url(url), "reward.remote_endpoints", f"endpoint {name!r}: {url!r} is not an http(s) URL")
            _check(name not in named, "reward.remote_endpoints", f"endpoint {name!r} is named twice")
            named[name] = url
        return named
