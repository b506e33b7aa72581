"""The reward plug-point: the signature every reward function (`reward.fn`) must have."""

from __future__ import annotations

from typing import Protocol


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
