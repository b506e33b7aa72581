"""Embedded rollout engine: a transformers causal LM generating in-process on CPU.

Generation is HF `model.generate` (batched, KV-cached, left-padded). Log-probs are not taken from
`output_logits=True`: that keeps every step's [B, V] logits alive until the end (B * T * V floats,
tens of GB for a real vocabulary), so a logits processor placed ahead of HF's temperature /
top-k / top-p warpers reads the raw logits of each step instead and keeps one [B, V] slice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from miles_core.rollout.base import FINISH_LENGTH, FINISH_STOP, Generation, SamplingParams


class _RawLogprobRecorder(LogitsProcessor):
    """Records log p(chosen token) under softmax(raw_logits / temperature), one step behind.

    HF calls processors before sampling, so at step t the token chosen at step t-1 is the last
    column of `input_ids`; the log-softmax of step t-1 is gathered then. `finish` gathers the
    last step once the final tokens are known. Returns scores unchanged.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.previous: torch.Tensor | None = None  # [B, V] log-softmax of the latest step
        self.gathered: list[torch.Tensor] = []  # per step: [B]

    def _gather_previous(self, tokens: torch.Tensor) -> None:
        self.gathered.append(self.previous.gather(-1, tokens[:, None]).squeeze(-1))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self._gather_previous(input_ids[:, -1])
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """generated: [B, S] new tokens as returned by generate -> [B, S] log-probs."""
        steps = generated.shape[1]
        if len(self.gathered) < steps:  # the last step's token was never fed back
            self._gather_previous(generated[:, -1])
        return torch.stack(self.gathered[:steps], dim=1)


def _read_pad_token_id(policy_dir: str, generation_config: GenerationConfig | None) -> int:
    """Pad id from generation_config.json, then tokenizer files, else 0 (it is always masked)."""
    if generation_config is not None and generation_config.pad_token_id is not None:
        pad = generation_config.pad_token_id
        return int(pad[0] if isinstance(pad, (list, tuple)) else pad)
    tokenizer_config = os.path.join(policy_dir, "tokenizer_config.json")
    if os.path.exists(tokenizer_config):
        with open(tokenizer_config) as f:
            pad_token = json.load(f).get("pad_token")
        if isinstance(pad_token, dict):
            pad_token = pad_token.get("content")
        if pad_token is not None:
            # The tokenizer maps the pad string to its id; loaded only when a pad token is declared.
            from transformers import AutoTokenizer

            pad_id = AutoTokenizer.from_pretrained(policy_dir).convert_tokens_to_ids(pad_token)
            if pad_id is not None:
                return int(pad_id)
    return 0


class TorchEngine:
    """RolloutEngine on a transformers causal LM in this process (CPU, fp32 by default).

    policy_dir: HF weight directory (config.json + safetensors).
    version: weight version of `policy_dir`.
    max_batch_sequences: sequences (prompts x n) per `model.generate` call; larger inputs are chunked.
    """

    def __init__(
        self,
        policy_dir: str,
        version: int = 0,
        max_batch_sequences: int = 256,
        dtype: torch.dtype = torch.float32,
    ):
        if max_batch_sequences < 1:
            raise ValueError(f"max_batch_sequences must be >= 1, got {max_batch_sequences}")
        self.max_batch_sequences = max_batch_sequences
        self.dtype = dtype
        self.weight_version = version
        self.load_weights(policy_dir, version)

    def load_weights(self, policy_dir: str, version: int) -> None:
        if not os.path.isfile(os.path.join(policy_dir, "config.json")):
            raise FileNotFoundError(f"policy_dir {policy_dir!r} has no config.json: not an HF weight directory")
        model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=self.dtype)
        model.eval()
        published = model.generation_config
        self.pad_token_id = _read_pad_token_id(policy_dir, published)
        # A clean config: the published one may carry sampling defaults (top_k, repetition_penalty,
        # eos ids) that would silently change the distribution; SamplingParams alone decides.
        model.generation_config = GenerationConfig(
            pad_token_id=self.pad_token_id, bos_token_id=published.bos_token_id if published else None
        )
        self.model = model
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.policy_dir = policy_dir
        self.weight_version = version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        self._check_prompts(prompts)
        expanded = [prompt for prompt in prompts for _ in range(params.n)]
        flat: list[Generation] = []
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(params.seed)
            for chunk in self._chunks(expanded):
                flat.extend(self._generate_batch(chunk, params))
        return [flat[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
            low, high = min(prompt), max(prompt)
            if low < 0 or high >= self.vocab_size:
                raise ValueError(
                    f"prompts[{i}] has token id {low if low < 0 else high} outside the vocabulary [0, {self.vocab_size})"
                )

    def _chunks(self, sequences: list[list[int]]) -> Iterator[list[list[int]]]:
        for start in range(0, len(sequences), self.max_batch_sequences):
            yield sequences[start : start + self.max_batch_sequences]

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)  # [B, L]
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, L]
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        return input_ids, attention_mask

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        input_ids, attention_mask = self._left_pad(prompts)
        recorder = _RawLogprobRecorder(params.temperature if not params.greedy else 1.0)
        sampling = (
            {"do_sample": False}
            if params.greedy
            else {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
        )
        sequences = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=list(params.stop_token_ids) or None,
            pad_token_id=self.pad_token_id,
            logits_processor=LogitsProcessorList([recorder]),
            use_cache=True,
            **sampling,
        )
        generated = sequences[:, input_ids.shape[1] :]  # [B, S]
        logprobs = recorder.finish(generated)  # [B, S]
        return self._to_generations(generated.tolist(), logprobs.tolist(), params)

    def _to_generations(
        self, generated: list[list[int]], logprobs: list[list[float]], params: SamplingParams
    ) -> list[Generation]:
        stop_ids = set(params.stop_token_ids)
        out = []
        for tokens, token_logprobs in zip(generated, logprobs):
            end = next((i + 1 for i, token in enumerate(tokens) if token in stop_ids), None)
            finish = FINISH_STOP if end is not None else FINISH_LENGTH
            end = end if end is not None else params.max_new_tokens
            out.append(Generation(tokens[:end], token_logprobs[:end], finish, self.weight_version))
        return out
