"""The reward plug-point: the signature every reward function (`reward.fn`) must have."""

from __future__ import annotations

from typing import NamedTuple, Protocol


class RewardFn(Protocol):
    """Scores one response; named in the config as a dotted path, e.g. `reward.fn: pkg.mod:fn`.

    `__call__(response, label, metadata) -> float`:

    * `response`: the decoded response text, without special tokens (no `<|im_end|>`) and
      without the prompt.
    * `label`: the prompt row's label as a string (numbers in prompt files are converted).
    * `metadata`: the prompt row's metadata dict (possibly empty), passed through unchanged.
    * returns a float in the configured `[reward.min, reward.max]`.
    * must never raise, whatever the response text: a policy can emit anything, and one bad
      sample must not fail a whole rollout batch; unparseable responses score `reward.min`.
    """

    def __call__(self, response: str, label: str, metadata: dict) -> float: ...


class Response(NamedTuple):
    """One response of a group, with the label and metadata of the prompt row it answers."""

    text: str  # decoded, special tokens skipped, without the prompt
    label: str
    metadata: dict


def each_sample(reward_fn: RewardFn, responses: list[Response]) -> list[float]:
    """Default of the `reward.group_fn` plug-point: scores a prompt's group of responses at once.

    `group_fn(reward_fn, responses) -> list[float]`, one reward per response, in order; each
    response is a `Response(text, label, metadata)` scored against its own label and metadata;
    `reward_fn` is the configured `reward.fn`. A group function sees all responses to one prompt
    (e.g. to rank them, or to reward diversity); this default scores each alone. A failure of
    the whole call scores every response of the group `reward.fallback`.
    """
    return [reward_fn(r.text, r.label, r.metadata) for r in responses]


def no_post_processing(samples: list, group_size: int) -> None:
    """Default of the `reward.post_fn` plug-point: leaves the rewards as scored.

    `post_fn(samples, group_size) -> None` may rewrite `sample.reward` in place after scoring
    (e.g. a length penalty, or DAPO's overlong shaping); samples come in groups of `group_size`.
    Results outside [reward.min, reward.max] are clamped afterwards, each named in a warning and counted
    (metric reward/out_of_range).
    """
