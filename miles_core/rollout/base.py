"""The rollout engine contract shared by every backend (embedded torch, SGLang over HTTP).

A trainer recomputes the log-probs of each response under the same policy and compares them
with what the engine reported (the train/rollout mismatch metric, TIS/MIS corrections). The
contract below fixes exactly which distribution `logprobs` refers to so that comparison is
meaningful for every engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses.

    n: responses per prompt.
    temperature: softmax temperature; 0 means greedy (argmax).
    top_p: nucleus sampling mass; 1.0 disables it.
    top_k: keep the k most likely tokens; 0 disables it.
    max_new_tokens: hard cap on response length ("length" finish when reached).
    stop_token_ids: generation of any of these ends the response ("stop" finish).
    seed: same prompts + params (incl. seed) + weights give identical output.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Generation:
    """One sampled response.

    tokens: response token ids exactly as generated; when a stop token ended generation it is
        included as the last token (finish_reason "stop") and nothing follows it; no padding.
    logprobs: logprobs[i] is the log-prob of tokens[i] under softmax(logits / temperature) of the
        policy at that step, before any top-k/top-p truncation and renormalisation (for
        temperature 0: under softmax(logits)). This is what a trainer recomputes.
    finish_reason: "stop" (ended by a stop token) or "length" (max_new_tokens reached).
    weight_version: the policy version that produced the whole response.
    routed_experts: with routing recorded (rollout.routing_replay), the experts of every position fed to the model
        (prompt and response but its last token), flattened [position, MoE layer, k] (miles_core/routing.py); else empty.
    drafted_tokens, accepted_tokens: with speculative decoding (rollout.speculative_tokens), the draft tokens proposed
        for this response and those the policy accepted (rollout/speculative.py); else 0.
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    routed_experts: list[int] = field(default_factory=list)
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses from token-id prompts with a versioned policy.

    Guarantees for every implementation:
    * `generate(prompts, params)[i]` holds `params.n` Generations for `prompts[i]`, in order.
    * Response tokens are exactly as generated, including the stop token that ended generation
      (finish "stop"), nothing after it, no padding; `len(tokens) == len(logprobs)`.
    * `logprobs` follow `Generation`'s definition: softmax(logits / temperature) without
      top-k/top-p renormalisation (softmax(logits) for temperature 0).
    * `weight_version` of each Generation is the version that produced the whole response.
    * Same prompts + params (incl. seed) + weights -> identical output.
    """

    weight_version: int

    def load_weights(self, policy_dir: str, version: int) -> None:
        """Load a published HF weight directory (config + safetensors) as policy `version`."""
        ...

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        """For each prompt (a list of token ids), sample `params.n` Generations."""
        ...
