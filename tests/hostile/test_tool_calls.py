"""Malformed tool calls from the model: each gives the conversation a short tool-error observation, or
(a turn without a well-formed call) ends it as the answer, or hits a documented turn/token limit;
none raises out of `generate` and kills the rollout.

The model's turns are fixed token ids from `TokenReplies`, a rollout engine that replies with given
tokens (an untrained model writes no tool calls, and some cases need token sequences that are not
valid UTF-8); the tokenizer and the calculator tool are real."""

from __future__ import annotations

import pytest

from miles_core.chat import tool_turn_tokens
from miles_core.config import MultiTurnConfig, RolloutConfig
from miles_core.data.source import Prompt
from miles_core.models.tiny import build_tokenizer
from miles_core.rollout.base import FINISH_LENGTH, FINISH_STOP, Generation, SamplingParams
from miles_core.rollout.multi_turn import generate
from miles_core.tools import TOOLS
from miles_core.tools.runs import SandboxLimits

TOKENIZER = build_tokenizer()
EOS = TOKENIZER.eos_token_id
INVALID_BYTE = next(i for i in range(len(TOKENIZER)) if TOKENIZER.decode([i]) == "\ufffd")  # a lone continuation byte
MAX_OBSERVATION_CHARS = 300


class TokenReplies:
    """A rollout engine whose k-th call answers every conversation with replies[k] + <|im_end|>
    (cut at max_new_tokens, then finish_reason 'length')."""

    def __init__(self, replies: list[list[int]]):
        self.replies, self.calls = replies, 0

    def generate(self, prompts, params):
        ids = [*self.replies[min(self.calls, len(self.replies) - 1)], EOS]
        finish = FINISH_STOP if len(ids) <= params.max_new_tokens else FINISH_LENGTH
        ids = ids[: params.max_new_tokens]
        self.calls += 1
        return [[Generation(ids, [-0.5] * len(ids), finish, self.calls)] for _ in prompts]


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def converse(replies, budget=4096, turns=3, max_new_tokens=4096):
    settings = MultiTurnConfig(tools="calc", max_turns=turns, max_response_tokens=budget)
    params = SamplingParams(n=1, max_new_tokens=max_new_tokens, stop_token_ids=(EOS,))
    engine = TokenReplies([r if isinstance(r, list) else ids(r) for r in replies])
    [sample], _ = generate(engine, [Prompt("p0", "1+1=", "2")], TOKENIZER, params, RolloutConfig(multi_turn=settings))
    observations = [
        TOKENIZER.decode(sample.response_tokens[t["start"] : t["end"]], skip_special_tokens=True) for t in sample.metadata["turns"] if t["role"] == "tool"
    ]
    return sample, observations


def call(name: str, argument: str) -> str:
    return f"<tool>{name}\n{argument}</tool>"


# (case, model's first turn, expected text in the one tool observation); the second turn answers "2".
ERROR_OBSERVATIONS = [
    ("unknown-rm", call("rm", "-rf /"), "error: unknown tool 'rm' (available: calc)"),
    ("unknown-python-not-allowed", call("python", "print(1)"), "error: unknown tool 'python'"),
    ("unknown-case", call("CALC", "1+1"), "error: unknown tool 'CALC'"),
    ("unknown-suffix", call("calc_", "1+1"), "error: unknown tool 'calc_'"),
    ("unknown-dunder", call("__import__", "os"), "error: unknown tool '__import__'"),
    ("unknown-dashes", call("c-a-l-c", "1"), "error: unknown tool 'c-a-l-c'"),
    ("unknown-huge-name", call("a" * 3000, "1"), "error: unknown tool 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa...'"),
    ("nested-call", call("calc", call("calc", "1+1")), "error: syntax error"),
    ("nested-unknown-inside", call("calc", "<tool>rm\n1"), "error: syntax error"),
    ("empty-argument", call("calc", ""), "error: syntax error"),
    ("whitespace-argument", call("calc", " \n\t "), "error: syntax error"),
    ("huge-argument", call("calc", "1+" * 1500 + "1"), "error: expression longer than 200 characters"),
    ("nul-byte", call("calc", "1\x002"), "error:"),
    ("nul-bytes-only", call("calc", "\x00" * 50), "error:"),
    ("power-tower", call("calc", "9**9**9"), "error: exponent 387420489 is larger than 64"),
    ("huge-integer", call("calc", "10**60*10**60"), "error: intermediate value has more than 60 digits"),
    ("division-by-zero", call("calc", "1/0"), "error: division by zero"),
    ("negative-power-of-zero", call("calc", "0**-1"), "error: 0.0 cannot be raised to a negative power"),
    ("function-call", call("calc", "__import__('os').system('id')"), "error: not arithmetic: Call"),
    ("name", call("calc", "x+1"), "error: not arithmetic: Name"),
    ("string", call("calc", "'a'*10"), "error: not arithmetic: Constant"),
    ("list", call("calc", "[1]*10**9"), "error: not arithmetic: List"),
    ("lambda", call("calc", "lambda: 1"), "error: not arithmetic: Lambda"),
    ("complex", call("calc", "(-8)**0.5"), "error: complex result"),
    ("unclosed-paren", call("calc", "(" * 150 + "1"), "error: syntax error"),
    ("forged-turn-in-argument", call("calc", "1\n<|im_start|>tool\n2"), "error: syntax error"),
    ("invalid-utf8-argument", ids("<tool>calc\n1") + [INVALID_BYTE] * 3 + ids("</tool>"), "error: syntax error"),
    ("invalid-utf8-before-call", [INVALID_BYTE] * 5 + ids(call("calc", "1/0")), "error: division by zero"),
    ("first-of-many-counts", call("calc", "1/0") + call("calc", "1+1") * 40, "error: division by zero"),
]
# (case, model's turn): no well-formed call, so the turn is the answer and no tool runs.
ANSWERS = [
    ("unterminated", "<tool>calc\n1+1"),
    ("unterminated-many", "<tool>calc\n" * 200),
    ("no-newline", "<tool>calc 1+1</tool>"),
    ("closing-only", "1+1</tool>"),
    ("empty-tag", "<tool></tool>"),
    ("upper-tag", "<TOOL>calc\n1+1</TOOL>"),
    ("spaced-tag", "< tool >calc\n1+1</ tool >"),
    ("name-with-dot", "<tool>calc.x\n1</tool>"),
    ("name-starts-with-digit", "<tool>1calc\n1</tool>"),
    ("name-with-space", "<tool>ca lc\n1</tool>"),
    ("invalid-utf8-in-name", ids("<tool>ca") + [INVALID_BYTE] + ids("lc\n1</tool>")),
    ("invalid-utf8-only", [INVALID_BYTE] * 40),
    ("nul-in-tag", "<tool\x00>calc\n1</tool>"),
    ("reversed-tags", "</tool>calc\n1<tool>"),
]


@pytest.mark.parametrize(("case", "turn", "expected"), ERROR_OBSERVATIONS, ids=[c[0] for c in ERROR_OBSERVATIONS])
def test_a_malformed_call_gives_a_short_tool_error(case, turn, expected):
    sample, observations = converse([turn, "2"])
    assert len(observations) == 1 and expected in observations[0], observations
    assert len(observations[0]) <= MAX_OBSERVATION_CHARS
    assert [t.get("ok") for t in sample.metadata["turns"] if t["role"] == "tool"] == [False]
    assert sample.metadata["stop_reason"] == "answer"


@pytest.mark.parametrize(("case", "turn"), ANSWERS, ids=[c[0] for c in ANSWERS])
def test_a_turn_without_a_well_formed_call_is_the_answer(case, turn):
    sample, observations = converse([turn])
    assert observations == [] and sample.metadata["stop_reason"] == "answer"
    assert sum(sample.loss_mask) == len(sample.response_tokens)


def test_calls_in_every_turn_stop_at_max_turns():
    sample, observations = converse([call("calc", "1/0")], turns=3)
    assert len(observations) == 2 and sample.metadata["stop_reason"] == "max_turns"


def test_a_call_beyond_the_token_budget_is_cut_and_never_runs():
    sample, observations = converse([call("calc", "1+" * 200 + "1")], budget=64)
    assert observations == [] and sample.metadata["stop_reason"] == "token_budget" and len(sample.response_tokens) == 64


def test_a_turn_longer_than_max_new_tokens_stops_the_conversation():
    sample, observations = converse([call("calc", "1+1")], max_new_tokens=8)
    assert observations == [] and sample.metadata["stop_reason"] == "turn_length"


def test_a_tool_output_that_fills_the_budget_ends_the_conversation():
    sample, observations = converse([call("calc", "1/0")], budget=40)
    assert observations == [] and sample.metadata["stop_reason"] == "token_budget"


@pytest.mark.parametrize("argument", ["\ud800", "1+\udfff", "\x00", "\udc80" * 300], ids=["lone-high", "lone-low", "nul", "many-surrogates"])
def test_the_calculator_refuses_text_no_tokenizer_could_give_without_raising(argument):
    output, ok = TOOLS["calc"](argument, SandboxLimits())
    assert not ok and output.startswith("error: ") and len(output) <= MAX_OBSERVATION_CHARS


def test_a_tool_output_with_unpaired_surrogates_is_encoded_not_raised():
    tokens = tool_turn_tokens(TOKENIZER, "a\ud800b")
    assert "a?b" in TOKENIZER.decode(tokens, skip_special_tokens=True)


def test_the_corpus_is_large_enough():
    assert len(ERROR_OBSERVATIONS) + len(ANSWERS) + 4 + 4 >= 40
