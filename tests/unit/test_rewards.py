"""The integer-answer reward (hand cases, never raises on arbitrary text), the math-verify reward
behind a deadline (hand cases, a deadline off the main thread, concurrent callers), and the worker
pool that holds the deadline."""

import concurrent.futures

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_core.rewards import RewardFn, integer_answer
from miles_core.rewards.math import math_answer, verified
from miles_core.rewards.verify import (
    VerificationFailed,
    VerificationTimeout,
    WorkerPool,
)


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


# --- math_answer: math-verify behind a deadline (the corpus is tests/unit/math_pairs.jsonl) ---

BIG = "9" * 200  # 10**200 - 1: BIG + 1 is "1" followed by 200 zeros


@pytest.mark.parametrize(
    "response,label,expected",
    [
        (BIG, BIG, 1.0),  # fast path: both integers
        ("1" + "0" * 200, BIG, 0.0),
        (f"So the answer is ${BIG}$.", BIG, 1.0),  # verified in a worker: exact, not a float
        (f"So the answer is ${BIG[:-1]}8$.", BIG, 0.0),
        ("1", "(1, 2)", 0.0),  # a part of a compound gold is not the answer
        ("1", "x=1, y=2", 0.0),
        ("\\boxed{1}", "\\{1,2\\}", 0.0),
        ("\\boxed{(1, 2)}", "(1, 2)", 1.0),
        ("\\boxed{\\frac{2}{4}}", "0.5", 1.0),
        (None, "1", 0.0),  # not text: not an answer
    ],
)
def test_math_answer_by_hand(response, label, expected):
    assert math_answer(response, label, {}) == expected


@settings(max_examples=40, deadline=None)
@given(response=st.text(max_size=40), label=st.sampled_from(["408", "\\frac{1}{2}", "(1, 2)", "\\text{Monday}", ""]))
def test_math_answer_never_raises_and_stays_in_range(response, label):
    assert math_answer(response, label, {}) in (0.0, 1.0)


def test_math_answer_fits_the_plug_point():
    from miles_core.plugins import PLUGPOINTS, load_function

    load_function("miles_core.rewards.math:math_answer", "reward.fn", PLUGPOINTS["reward.fn"])


@pytest.mark.parametrize("answer", ["$9^{9^{9^{9}}}$", "(" * 300 + "1" + ")" * 300])
def test_verification_deadline_holds_off_the_main_thread(answer):
    """A tower of powers (9^(9^387420489) has ~10^369693099 digits) or deep nesting never finishes
    in sympy; off the main thread (no SIGALRM) it still scores 0 at the deadline, and the next
    answer is verified by a fresh worker."""
    with concurrent.futures.ThreadPoolExecutor(1) as threads:
        assert threads.submit(verified, "1", answer, timeout_s=1.0).result(timeout=120) == 0.0
        assert threads.submit(verified, "2", "$\\frac{4}{2}$", timeout_s=30.0).result(timeout=120) == 1.0


def test_concurrent_callers_each_get_their_own_verdict():
    cases = [("\\frac{1}{2}", "0.5", 1.0), ("\\sqrt{2}", "$\\sqrt{3}$", 0.0), ("2\\pi", "$2\\pi$", 1.0), ("[1, 3)", "(1, 3)", 0.0)] * 3
    with concurrent.futures.ThreadPoolExecutor(6) as threads:
        got = list(threads.map(lambda case: verified(case[0], case[1], timeout_s=60.0), cases))
    assert got == [expected for _, _, expected in cases]


@pytest.fixture
def pool():
    workers = WorkerPool("time:sleep", size=1)
    yield workers
    workers.close()


def test_worker_pool_replaces_a_worker_past_its_deadline(pool):
    with pytest.raises(VerificationTimeout, match="did not finish within 0.5s"):
        pool.call(600, timeout_s=0.5)  # a 10-minute call: only the deadline ends it
    assert pool.call(0, timeout_s=60.0) is None


def test_worker_pool_raises_what_the_target_raised():
    workers = WorkerPool("json:loads", size=1)
    try:
        with pytest.raises(ValueError, match="Expecting value"):
            workers.call("not json", timeout_s=60.0)
        assert workers.call("[1, 2]", timeout_s=60.0) == [1, 2]
    finally:
        workers.close()


def test_worker_pool_reports_a_dead_worker():
    workers = WorkerPool("os:_exit", size=1)
    try:
        with pytest.raises(VerificationFailed, match=r"worker died \(exit code 3\)"):
            workers.call(3, timeout_s=60.0)
    finally:
        workers.close()


def test_worker_pool_needs_a_worker():
    with pytest.raises(ValueError, match="size must be >= 1, got 0"):
        WorkerPool("time:sleep", size=0)
