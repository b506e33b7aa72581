"""`math_answer` against a corpus of gold/prediction pairs (tests/unit/math_pairs.jsonl), each
verdict derived by hand or from math-verify's documented behaviour, the reason in its `why`:
LaTeX golds (fractions, roots, pi, intervals, sets, tuples, percentages, units, text), compound
golds with partial predictions (always 0), equivalent forms, negative and huge integers, and
malformed input. Reports the agreement and requires all of it."""

from __future__ import annotations

import json
from pathlib import Path

from miles_core.rewards.math import math_answer

PAIRS = Path(__file__).with_name("math_pairs.jsonl")
KEYS = {"gold": str, "prediction": str, "expected": float, "why": str}


def load_pairs() -> list[dict]:
    pairs = []
    for number, line in enumerate(PAIRS.read_text(encoding="utf-8").splitlines(), start=1):
        row = json.loads(line)
        for key, kind in KEYS.items():
            if not isinstance(row.get(key), kind) or (key == "expected" and row[key] not in (0.0, 1.0)):
                raise ValueError(f"{PAIRS.name} row {number}: key {key!r} must be a {kind.__name__} (0.0 or 1.0 for expected), got {row.get(key)!r}")
        pairs.append(row)
    return pairs


def test_corpus_is_large_and_covers_partial_answers():
    pairs = load_pairs()
    assert len(pairs) >= 150
    compound = [p for p in pairs if p["gold"] in ("(1, 2)", "x=1, y=2", "\\{1,2\\}")]
    assert any(p["prediction"] == "1" and p["expected"] == 0.0 for p in compound)


def test_math_answer_agrees_with_every_pair(capsys):
    pairs = load_pairs()
    wrong = [(p, got) for p in pairs if (got := math_answer(p["prediction"], p["gold"], {})) != p["expected"]]
    with capsys.disabled():
        print(f"\nmath corpus agreement: {len(pairs) - len(wrong)}/{len(pairs)} ({100 * (len(pairs) - len(wrong)) / len(pairs):.1f}%)")
    assert not wrong, "\n".join(
        f"gold {p['gold'][:60]!r} prediction {p['prediction'][:60]!r}: expected {p['expected']}, got {got} ({p['why']})" for p, got in wrong
    )
