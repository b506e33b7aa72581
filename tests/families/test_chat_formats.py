"""Each family's chat template against `miles_core.chat`, SFT demonstrations and the multi-turn rollout.

The expected loss mask is read off the template's own rendering of a whole conversation (a user
question, a tool call, the tool's output, the answer): a token is the model's exactly when its
characters lie in an assistant message's content or in the special token that follows it (the
family's end of turn, or the token that ends a tool-calling turn).  `prompt_tokens` followed by
`conversation_tokens` must be that rendering token for token with that mask; SFT demonstrations
and a multi-turn rollout (a scripted engine writing the same turns) must give the same.
"""

from __future__ import annotations

import pytest

from miles_core.chat import conversation_tokens, prompt_tokens, response_tokens, tool_call_end
from miles_core.config import MultiTurnConfig, RolloutConfig
from miles_core.data.source import Prompt
from miles_core.models.families import FAMILIES as TABLE
from miles_core.rollout.base import FINISH_STOP, Generation, SamplingParams
from miles_core.rollout.multi_turn import generate as multi_turn
from miles_core.train.sft import demonstrations
from tests.families.conftest import FAMILIES

pytestmark = pytest.mark.families

QUESTION, CALL, OUTPUT, ANSWER = "What is 2*3?", "<tool>calc\n2*3</tool>", "6", "The answer is 6."
TURNS = [{"role": "assistant", "content": CALL}, {"role": "tool", "content": OUTPUT}, {"role": "assistant", "content": ANSWER}]


def rendered_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(token ids, model-token mask) of the template's rendering of `messages`, the mask from character spans."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0
    specials = sorted(tokenizer.all_special_tokens, key=len, reverse=True)
    for message in messages:
        start = text.index(message["content"], cursor)
        cursor = start + len(message["content"])
        if message["role"] == "assistant":
            end_token = next(t for t in specials if text.startswith(t, cursor))  # the turn's end: a special token
            cursor += len(end_token)
            spans.append((start, cursor))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= lo and hi <= b for a, b in spans)) for lo, hi in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


@pytest.mark.parametrize("arch", FAMILIES)
def test_conversation_tokens_are_the_rendered_template_with_the_models_tokens_masked(arch, family_tokenizer):
    tokenizer = family_tokenizer(arch)
    expected_ids, expected_mask = rendered_mask(tokenizer, [{"role": "user", "content": QUESTION}, *TURNS])
    prompt = prompt_tokens(tokenizer, QUESTION)
    tokens, mask = conversation_tokens(tokenizer, TURNS)
    ids = prompt + tokens
    assert ids == expected_ids[: len(ids)], tokenizer.decode(ids)
    assert [0] * len(prompt) + mask == expected_mask[: len(ids)]
    assert not any(expected_mask[len(ids) :])  # what the template renders after the last end of turn is not the model's
    assert tokens[-1] == tokenizer.eos_token_id and tokens[len(tokenizer(CALL, add_special_tokens=False)["input_ids"])] == tool_call_end(tokenizer)
    ends = {TABLE[arch].chat.eos, TABLE[arch].chat.tool_call_end or TABLE[arch].chat.eos}
    assert {tokenizer.convert_ids_to_tokens(t) for t, m in zip(tokens, mask) if m and t in tokenizer.all_special_ids} == ends


@pytest.mark.parametrize("arch", FAMILIES)
def test_sft_demonstrations_mask_exactly_the_models_tokens(arch, family_tokenizer):
    tokenizer = family_tokenizer(arch)
    conversation, answer = demonstrations([Prompt("p", QUESTION, "6", {"demonstrations": [TURNS, ANSWER]})], tokenizer)
    assert (conversation.response_tokens, conversation.loss_mask) == conversation_tokens(tokenizer, TURNS)
    expected_ids, expected_mask = rendered_mask(tokenizer, [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}])
    ids = answer.prompt_tokens + answer.response_tokens
    assert answer.response_tokens == response_tokens(tokenizer, ANSWER)
    assert ids == expected_ids[: len(ids)] and [0] * len(answer.prompt_tokens) + answer.loss_mask == expected_mask[: len(ids)]


class ScriptedEngine:
    """Writes the tool call, then the answer, each ended by the stop token a real model would write there:
    the family's tool-call end (which the rollout must ask to stop on) and its end of turn."""

    def __init__(self, tokenizer):
        self.tokenizer, self.turns, self.weight_version = tokenizer, [(CALL, tool_call_end(tokenizer)), (ANSWER, tokenizer.eos_token_id)], 0

    def generate(self, prompts, params: SamplingParams):
        text, stop = self.turns.pop(0)
        assert stop in params.stop_token_ids
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [stop]
        return [[Generation(ids, [-0.5] * len(ids), FINISH_STOP, 0)] for _ in prompts]


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_multi_turn_rollout_lays_out_the_conversation_as_the_template(arch, family_tokenizer):
    tokenizer = family_tokenizer(arch)
    params = SamplingParams(n=1, max_new_tokens=32, stop_token_ids=(tokenizer.eos_token_id,))
    settings = RolloutConfig(multi_turn=MultiTurnConfig(tools="calc", max_turns=3))
    (sample,), _ = multi_turn(ScriptedEngine(tokenizer), [Prompt("p", QUESTION, "6")], tokenizer, params, settings)
    assert sample.metadata["stop_reason"] == "answer" and [t["role"] for t in sample.metadata["turns"]] == ["assistant", "tool", "assistant"]
    assert (sample.response_tokens, sample.loss_mask) == conversation_tokens(tokenizer, TURNS)
