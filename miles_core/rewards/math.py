"""Math answer rewards: exact integer match of the response's first integer against the label.

The default of the `reward.fn` plug-point (signature: `miles_core.rewards.base.RewardFn`), for
the addition problem set.  It departs from math-verify style checking on
purpose: the tiny policy answers with a bare integer, and a plain regex is exact, total (never
raises) and does not depend on sympy parsing of arbitrary model output.
"""

from __future__ import annotations

import re

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
