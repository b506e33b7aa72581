r"""Whether a prediction states the gold answer, judged as mathematics by math-verify; runs in a
verification worker (rewards/verify.py), never in the scorer's own process.

Departs from calling `math_verify.verify(parse(gold), parse(prediction))` as-is, on purpose:

* `parse` returns several candidates (the parsed answer and its text), and `verify` accepts a match
  of *any* gold candidate with *any* predicted one, so a prediction that equals one part of a
  compound gold (`1` for `(1, 2)`) could score 1. Here the gold's single, whole parsed answer is
  compared with the prediction's single final answer (math-verify's first extraction: the last
  `\boxed{}`, else the last `$...$`, else the last number).
* The gold is a bare answer, so it is parsed whole as LaTeX (`1/2`, `\frac{1}{2}`, `(1, 2)`,
  `x=1, y=2`, `50\%`, `5\text{ cm}` alike). So is a prediction that is a bare expression, with no
  delimiters and no prose (`\sqrt 2`, `(1,2)`); math-verify alone would read only its last number.
* A gold that is words (`Monday`, `\text{no solution}`) is compared as normalised text:
  math-verify would read `Monday` as the product m*o*n*d*a*y, equal to `dynamo`.

What math-verify decides, kept as is: numbers compare exactly unless one side is a decimal, then
rounded to 6 places (`1/3` = `0.333333`, `\pi` != `3.14`); a percentage equals its number
(`50\%` = `50`) but not its fraction (`50\%` != `0.5`); units are dropped (`5\text{ cm}` = `5`);
intervals compare bounds and openness; sets ignore order, tuples keep it; `x = 2` states `2`.
"""

from __future__ import annotations

import logging
import re
import sys

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from miles_core.rewards.math import last_boxed

logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warning: verify.py keeps the deadline

# The answer's final \boxed{} first, then the other LaTeX and plain-number extractions.
_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed")
_LATEX_COMMAND = re.compile(r"\\[a-zA-Z]+")
_WORD = re.compile(r"[a-zA-Z]{2,}")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textit|textnormal|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_MATH_WORDS = frozenset(
    ["pi", "infty", "infinity", "inf", "oo", "sqrt", "frac", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "mod", "gcd", "lcm"]
)
_ANSWER_PREFIX = re.compile(r"^(?:(?:so|thus|therefore|hence|the|final|answer|is)\s+)+")


def same_answer(gold: str, prediction: str) -> bool:
    """True when `prediction`'s final answer equals the whole of the bare answer `gold`. Never raises."""
    sys.set_int_max_str_digits(0)  # integers of any size: this process is a worker, killed when it overruns
    try:
        words = text_answer(gold)
        if words is not None:
            return bool(words) and words == _normalised_text(_final_text(prediction))
        expected, stated = _first(parse(_as_latex(gold), _EXTRACTION, parsing_timeout=None)), _final_answer(prediction)
        return expected is not None and stated is not None and verify(expected, stated, timeout_seconds=None)
    except Exception:  # noqa: BLE001 - math-verify and sympy raise all kinds on what a policy writes: not an answer
        return False


def text_answer(gold: str) -> str | None:
    r"""The normalised words of a gold answer that is prose (`Monday`, `\text{no solution}`), else None."""
    inner = _unwrapped(gold)
    words = _WORD.findall(inner)
    if not re.fullmatch(r"[a-zA-Z][a-zA-Z '\-]*[a-zA-Z]\.?", inner) or not words or any(w.lower() in _MATH_WORDS for w in words):
        return None
    return _normalised_text(inner)


def _unwrapped(text: str) -> str:
    r"""`text` without `$` delimiters, one outer `\boxed{}` and `\text{}`-like wrappers."""
    text = text.strip().strip("$").strip()
    boxed = re.fullmatch(r"\\boxed\{(.*)\}", text, re.DOTALL)
    return _TEXT_WRAPPER.sub(r"\1", boxed.group(1) if boxed else text).strip()


def _normalised_text(text: str) -> str:
    """Lower case, letters, digits and single spaces, without a leading `the answer is`."""
    words = re.sub(r"[^a-z0-9 ]+", " ", _unwrapped(text).lower())
    return _ANSWER_PREFIX.sub("", " ".join(words.split()))


def _final_text(prediction: str) -> str:
    r"""The text of the prediction's final answer: its last `\boxed{}` if any, else all of it."""
    boxed = last_boxed(prediction)
    return prediction if boxed is None else boxed


def _is_bare_expression(text: str) -> bool:
    """No delimiters and no prose: the whole text is the answer (`(1,2)`, `\\sqrt 2`, `1 or 2`);
    `or` and `and` join the parts of one answer (so `1 or 2` is not read as its last number)."""
    words = _WORD.findall(_LATEX_COMMAND.sub(" ", _TEXT_WRAPPER.sub(" ", text)))
    return not _DELIMITED.search(text) and all(w.lower() in ("or", "and") for w in words)


def _as_latex(answer: str) -> str:
    """A bare answer between `$` (without its escaped dollar signs: `\\$5` is 5), else as given."""
    return answer if _DELIMITED.search(answer) else "$" + answer.replace("\\$", "").strip() + "$"


def _final_answer(prediction: str):
    """The prediction's final answer, parsed (a sympy object, or its text when it does not parse)."""
    if _is_bare_expression(prediction):
        whole = _first(parse(_as_latex(prediction), _EXTRACTION, parsing_timeout=None))
        if whole is not None and not isinstance(whole, str):
            return whole
    return _first(parse(prediction, _EXTRACTION, parsing_timeout=None))


def _first(candidates: list):
    """math-verify's best extraction (a parsed answer before its text fallback), else None."""
    return candidates[0] if candidates else None
