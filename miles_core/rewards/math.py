r"""Math answer rewards: `integer_answer` (exact integer match, the default `reward.fn`) and
`math_answer` (the answer judged as mathematics by math-verify, against a gold written in LaTeX
or plain text). Both have the `miles_core.rewards.base.RewardFn` signature and never raise.

`integer_answer` departs from math-verify style checking on purpose: the tiny policy answers with
a bare integer, and a plain regex is exact, total, fast (no sympy, no worker process) and does not
depend on sympy parsing of arbitrary model output.

`math_answer` compares the prediction's final answer with the whole gold answer (see
rewards/judge.py for how that departs from math-verify's `verify(parse(gold), parse(pred))`).
Integers, of any size, are compared here as text; everything else is verified in a worker
process with a deadline (rewards/verify.py), so a pathological answer (`9^9^9^9`) scores 0 after
`VERIFY_TIMEOUT_S` on any thread instead of hanging the scorer.
"""

from __future__ import annotations

import logging
import re

from miles_core.rewards.verify import VerificationFailed, shared_pool

logger = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = 5.0  # per answer; math-verify's own default
_JUDGE = "miles_core.rewards.judge:same_answer"

# ASCII digits only: `\d` would also accept other scripts' digits, which no label uses.
_INTEGER = re.compile(r"-?[0-9]+")
_LABEL_INTEGER = re.compile(r"[+-]?[0-9]+")


def _canonical(number: str) -> str:
    """Sign and digits without leading zeros; compared as text because int() of a
    huge digit string raises (Python's int max_str_digits limit)."""
    negative = number.startswith("-")
    digits = number.lstrip("+-").lstrip("0") or "0"
    return "-" + digits if negative and digits != "0" else digits


def first_integer(response: str) -> str | None:
    """The first integer (optional leading minus, ASCII digits) in `response`, canonicalised."""
    match = _INTEGER.search(response.strip())
    return _canonical(match.group()) if match else None


def integer_answer(response: str, label: str, metadata: dict) -> float:
    """1.0 when the response's first integer equals the integer label, else 0.0.

    A label that is not an integer is compared, stripped, with the stripped response.
    Never raises (see `miles_core.rewards.base.RewardFn`).
    """
    if not isinstance(response, str):
        return 0.0
    expected = str(label).strip()
    if not _LABEL_INTEGER.fullmatch(expected):
        return float(response.strip() == expected)
    return float(first_integer(response) == _canonical(expected))


def last_boxed(text: str) -> str | None:
    r"""The content of the last \boxed{...} (braces balanced), else None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None


def _bare_integer(text: str) -> str | None:
    r"""`text` (without `$` and spaces) as a canonical integer when it is one, else None."""
    compact = "".join(text.split()).strip("$")
    return _canonical(compact) if _LABEL_INTEGER.fullmatch(compact) else None


def _integer_verdict(gold: str, answer: str) -> float | None:
    r"""The verdict when gold and the answer's final answer (the whole answer, or its last
    \boxed{}) are both integers, else None (verification needed)."""
    expected = _bare_integer(last_boxed(gold) or gold)
    if expected is None:
        return None
    boxed = last_boxed(answer)
    stated = _bare_integer(answer if boxed is None else boxed)
    return None if stated is None else float(stated == expected)


def verified(gold: str, answer: str, timeout_s: float = VERIFY_TIMEOUT_S) -> float:
    """1.0 when `answer`'s final answer equals the whole `gold` answer, else 0.0; a verification
    that overruns `timeout_s` seconds (or whose worker dies) scores 0.0. Never raises."""
    if not isinstance(answer, str):
        return 0.0
    fast = _integer_verdict(str(gold), answer)
    if fast is not None:
        return fast
    try:
        return float(shared_pool(_JUDGE).call(str(gold), answer, timeout_s=timeout_s))
    except VerificationFailed as err:
        logger.warning("math answer scored 0: %s (gold %.80r, answer %.80r)", err, gold, answer)
        return 0.0


def math_answer(response: str, label: str, metadata: dict) -> float:
    r"""1.0 when the response's final answer (last `\boxed{}`, else last `$...$`, else last number;
    or all of it when it is a bare expression) equals the label, judged as mathematics, else 0.0."""
    return verified(str(label), response)
