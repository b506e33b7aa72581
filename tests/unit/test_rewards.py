"""The integer-answer reward: hand cases and a never-raises property over arbitrary text."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_core.rewards import RewardFn, integer_answer


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("132", "132", 1.0),
        ("  132\n", "132", 1.0),
        ("0132", "132", 1.0),
        ("132 because 47+85", "132", 1.0),
        ("The answer is 132.", "132", 1.0),
        ("122", "132", 0.0),
        ("13 2", "132", 0.0),  # the first integer is 13
        ("-5", "-5", 1.0),
        ("5", "-5", 0.0),
        ("-0", "0", 1.0),
        ("132", " +132 ", 1.0),
        ("", "132", 0.0),
        ("no digits here", "132", 0.0),
        ("١٣٢", "132", 0.0),  # non-ASCII digits are not an answer
        ("9" * 10000, "9" * 10000, 1.0),  # beyond int()'s digit limit
        ("9" * 10000, "132", 0.0),
        ("yes", "yes", 1.0),
        (" yes ", "yes", 1.0),
        ("no", "yes", 0.0),
        ("3.5", "3.5", 1.0),
        ("3.50", "3.5", 0.0),
    ],
)
def test_integer_answer_by_hand(response, label, expected):
    assert integer_answer(response, label, {}) == expected


GARBAGE = ["", " ", "\x00", "-", "--", "+", "-+-", "∞", "NaN", "1e309", "🤖 42 🤖", "\ud800", "<|im_end|>", "\n" * 100]


@pytest.mark.parametrize("response", GARBAGE)
def test_garbage_never_raises(response):
    assert integer_answer(response, "42", {}) in (0.0, 1.0)


@settings(max_examples=300, deadline=None)
@given(response=st.text(), label=st.one_of(st.text(), st.integers().map(str)))
def test_never_raises_and_stays_in_range(response, label):
    reward = integer_answer(response, label, {"id": "x"})
    assert isinstance(reward, float) and reward in (0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(value=st.integers(), prefix=st.text(alphabet=st.characters(blacklist_characters="-0123456789")))
def test_first_integer_after_any_non_numeric_prefix(value, prefix):
    assert integer_answer(f"{prefix}{value} and 7", str(value), {}) == 1.0


def test_matches_the_plug_point_protocol():
    fn: RewardFn = integer_answer
    assert fn("1", "1", {}) == 1.0
