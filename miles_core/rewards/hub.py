"""The reward hub: built-in reward functions (each a `reward.fn`), and one that picks per sample.

Every function has the `RewardFn` signature `(response, label, metadata) -> float` and scores the
response's *final turn*: in a multi-turn response (rollout/multi_turn.py) the text after the last
`assistant` turn, so a number inside a tool call or a tool's output is never taken for the answer.

* `math_answer`: the final turn judged as mathematics against the label (rewards/math.py `verified`:
  math-verify in a worker process with a deadline; the gold's whole answer against the final answer).
* `boxed_math`: the same, but only the last `\\boxed{...}` counts; no box scores 0.
* `integer`: the first integer of the final turn equals the integer label (rewards/math.py).
* `exact_match` / `f1`: SQuAD-style normalised string equality / token-level F1 for short answers.
* `format_boxed`: 1 when the final turn holds exactly one `\\boxed{...}`; `format_regex`: 1 when
  it fully matches `metadata["format_pattern"]`, matched by the `regex` engine with a time limit
  (reward.regex_timeout_s) and a pattern-length cap, so a backtracking pattern cannot stall scoring.
* `remote`: a reward model over HTTP (rewards/remote.py) at reward.remote_url, or at the endpoint
  of reward.remote_endpoints that `metadata["reward_endpoint"]` names: a prompt picks among the
  recipe's endpoints by name and never supplies an address.
* `by_metadata`: picks one of the above by `metadata["reward_type"]` (default reward.default_type).

A failure (unknown type, remote model down) raises; `step.score` records it and scores
reward.fallback, except `RemoteRewardUnavailable` (the endpoint's circuit breaker is open), which
fails the step. `batched` gives `step.score` the remote model's rewards of a whole batch at once,
within reward.remote_batch_timeout_s.
"""

from __future__ import annotations

import collections
import json
import string
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import regex  # time-limited matching (a dependency of transformers)

from miles_core.config import RewardConfig
from miles_core.rewards.base import Response
from miles_core.rewards.math import integer_answer, last_boxed, verified
from miles_core.rewards.remote import RemotePolicy, remote_reward, remote_rewards

_LAST_ASSISTANT = "\nassistant\n"  # how a tool turn ends, once special tokens are stripped


def final_turn(response: str) -> str:
    """The last assistant turn of a decoded (special tokens skipped) multi-turn response."""
    return response.rsplit(_LAST_ASSISTANT, 1)[-1]


def math_answer(response: str, label: str, metadata: dict) -> float:
    return verified(str(label), final_turn(response))


def boxed_math(response: str, label: str, metadata: dict) -> float:
    boxed = last_boxed(final_turn(response))
    return 0.0 if boxed is None else verified(str(label), f"\\boxed{{{boxed}}}")


def integer(response: str, label: str, metadata: dict) -> float:
    return integer_answer(final_turn(response), label, metadata)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles (a, an, the), single spaces (SQuAD's normalisation)."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def exact_match(response: str, label: str, metadata: dict) -> float:
    return float(normalize_answer(final_turn(response)) == normalize_answer(str(label)))


def f1(response: str, label: str, metadata: dict) -> float:
    predicted, gold = normalize_answer(final_turn(response)).split(), normalize_answer(str(label)).split()
    common = sum((collections.Counter(predicted) & collections.Counter(gold)).values())
    if not predicted or not gold:
        return float(predicted == gold)
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def format_boxed(response: str, label: str, metadata: dict) -> float:
    return float(final_turn(response).count("\\boxed{") == 1 and last_boxed(final_turn(response)) is not None)


def format_regex(response: str, label: str, metadata: dict, reward_cfg: RewardConfig | None = None) -> float:
    cfg = reward_cfg or RewardConfig()
    pattern = metadata.get("format_pattern")
    if not isinstance(pattern, str):
        raise TypeError("format_regex needs metadata['format_pattern'] (a regular expression)")
    if len(pattern) > cfg.regex_max_pattern_chars:
        raise ValueError(f"metadata['format_pattern'] has {len(pattern)} characters, over reward.regex_max_pattern_chars={cfg.regex_max_pattern_chars}")
    try:
        matched = regex.fullmatch(pattern, final_turn(response).strip(), regex.DOTALL, timeout=cfg.regex_timeout_s)
    except regex.error as err:
        raise ValueError(f"metadata['format_pattern'] {pattern[:80]!r} is not a regular expression: {err}") from None
    except TimeoutError:
        raise ValueError(f"metadata['format_pattern'] {pattern[:80]!r} took over reward.regex_timeout_s={cfg.regex_timeout_s}s to match") from None
    return float(matched is not None)


def remote_policy(cfg: RewardConfig) -> RemotePolicy:
    """The remote client's limits, from the reward section."""
    return RemotePolicy(
        timeout_s=cfg.remote_timeout_s,
        retries=cfg.remote_retries,
        backoff_s=cfg.remote_backoff_s,
        max_response_bytes=cfg.remote_max_response_bytes,
        concurrency=cfg.remote_concurrency,
        max_consecutive_failures=cfg.remote_max_consecutive_failures,
        breaker_reset_s=cfg.remote_breaker_reset_s,
        reward_range=(cfg.min, cfg.max),
        out_of_range=cfg.remote_out_of_range,
    )


def remote_url_for(metadata: dict, cfg: RewardConfig) -> str:
    """The recipe's endpoint for this prompt: reward.remote_url, or the reward.remote_endpoints entry
    metadata["reward_endpoint"] names. A prompt never supplies an address (not even in "reward_url")."""
    if "reward_url" in metadata:
        raise ValueError("metadata['reward_url'] is not accepted: a prompt may name one of reward.remote_endpoints in metadata['reward_endpoint']")
    name = metadata.get("reward_endpoint")
    if name is None:
        if not cfg.remote_url:
            raise ValueError("remote reward: set reward.remote_url (or reward.remote_endpoints and metadata['reward_endpoint'])")
        return cfg.remote_url
    endpoints = cfg.endpoints()
    if not isinstance(name, str) or name not in endpoints:
        raise ValueError(f"metadata['reward_endpoint'] {str(name)[:80]!r} is not one of reward.remote_endpoints ({', '.join(endpoints) or 'none declared'})")
    return endpoints[name]


def remote(response: str, label: str, metadata: dict, reward_cfg: RewardConfig | None = None) -> float:
    cfg = reward_cfg or RewardConfig()
    return remote_reward(remote_url_for(metadata, cfg), final_turn(response), label, metadata, remote_policy(cfg))


def batched(reward_fn: Callable, responses: list[Response], cfg: RewardConfig) -> Callable:
    """reward_fn as the group functions call it. For `remote` (reward.fn: ...hub:remote), every
    response's reward is fetched first, reward.remote_concurrency at a time and all within
    reward.remote_batch_timeout_s (`remote_rewards`), each distinct request once, and the returned
    function answers from those; a failed sample's call raises its error. Any other reward_fn is
    returned as it is."""
    if getattr(reward_fn, "func", reward_fn) is not remote:
        return reward_fn
    fetched: dict[tuple, float | Exception] = {}
    by_url: dict[str, dict[tuple, tuple]] = collections.defaultdict(dict)  # url -> {request key: (response, label, metadata)}
    for r in responses:
        key = _request_key(r.text, r.label, r.metadata)
        try:
            by_url[remote_url_for(r.metadata, cfg)][key] = (final_turn(r.text), r.label, r.metadata)
        except ValueError as err:
            fetched[key] = err
    with ThreadPoolExecutor(max(len(by_url), 1)) as pool:  # every endpoint at once: the batch's deadline is one for all of them
        results = pool.map(
            lambda requests: remote_rewards(requests[0], list(requests[1].values()), remote_policy(cfg), cfg.remote_batch_timeout_s), by_url.items()
        )
        for (_, requests), rewards in zip(by_url.items(), results):
            fetched.update(zip(requests, rewards))

    def answer(response: str, label: str, metadata: dict) -> float:
        result = fetched.get(_request_key(response, label, metadata))
        if result is None:  # a group function asked about a response it was not given
            return reward_fn(response, label, metadata)
        if isinstance(result, Exception):
            raise result
        return result

    return answer


def _request_key(response: str, label: str, metadata: dict) -> tuple:
    return final_turn(response), str(label), json.dumps(metadata, sort_keys=True, default=str)


REWARDS = {
    "math": math_answer,
    "boxed": boxed_math,
    "integer": integer,
    "exact": exact_match,
    "f1": f1,
    "format_boxed": format_boxed,
    "format_regex": format_regex,
    "remote": remote,
}


def by_metadata(response: str, label: str, metadata: dict, reward_cfg: RewardConfig | None = None) -> float:
    """The reward named by metadata["reward_type"] (else reward.default_type); see REWARDS."""
    cfg = reward_cfg or RewardConfig()
    kind = metadata.get("reward_type", cfg.default_type)
    if kind not in REWARDS:
        raise ValueError(f"metadata['reward_type'] {kind!r} is not a reward type (available: {', '.join(REWARDS)})")
    fn = REWARDS[kind]
    return fn(response, label, metadata, reward_cfg=cfg) if fn in (remote, format_regex) else fn(response, label, metadata)
