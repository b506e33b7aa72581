"""The "addition" problem set: `a+b=` prompts with integer labels and an imperfect teacher.

Each row carries, besides the prompt and the correct label, `demonstrations`: the answers an
imperfect teacher writes in `data.teacher_samples` independent attempts.  The teacher adds column by column like a pupil and forgets each carry
it should propagate into the next column with probability `data.teacher_carry_error`.  Problems
without carries are therefore always demonstrated correctly and problems with carries often
wrongly (47+85 becomes 122).  The attempts are independent, so SFT learns the teacher's
distribution rather than memorising one answer per problem: with an error above one half its
greedy answer drops the carry.  That gap is the point of the problem set: SFT on the
demonstrations imitates the teacher's mistakes and plateaus at the teacher's accuracy, while RL
with a verifier (the exact-answer reward) is scored against the true label and can go beyond
the teacher.  `metadata.carries` lets evaluation split accuracy by difficulty.

Operands have exactly `data.digits` digits without leading zeros (1..9 for one digit, 10..99
for two).  Everything is deterministic from `data.seed`; the test split does not depend on
`data.train_size`.
"""

from __future__ import annotations

import json
import os
import random

from miles_core.config import DataConfig
from miles_core.storage import atomic_file

PROBLEM_SET = "addition"


def _digits_of(n: int, width: int) -> list[int]:
    """Least significant digit first, zero-padded to `width`."""
    return [(n // 10**i) % 10 for i in range(width)]


def count_carries(a: int, b: int) -> int:
    """Carries of the correct column addition that flow into another operand column.

    The carry out of the top column only writes the leading digit, so it is not counted: it is
    not one the teacher can drop.
    """
    width = max(len(str(a)), len(str(b)))
    carry, carries = 0, 0
    for i, (da, db) in enumerate(zip(_digits_of(a, width), _digits_of(b, width))):
        carry = (da + db + carry) // 10
        carries += int(carry == 1 and i < width - 1)
    return carries


def teacher_answer(a: int, b: int, carry_error: float, rng: random.Random) -> str:
    """The imperfect teacher's sum of two non-negative integers, as a decimal string.

    Column by column from the right; each carry into another column is dropped with
    probability `carry_error`, drawn from `rng` once per carry (not at all without carries).
    """
    if a < 0 or b < 0:
        raise ValueError(f"teacher_answer takes non-negative operands, got {a} and {b}")
    width = max(len(str(a)), len(str(b)))
    carry, out = 0, []
    for i, (da, db) in enumerate(zip(_digits_of(a, width), _digits_of(b, width))):
        total = da + db + carry
        out.append(total % 10)
        carry = total // 10
        if carry and i < width - 1 and rng.random() < carry_error:
            carry = 0
    if carry:
        out.append(carry)
    return str(int("".join(str(d) for d in reversed(out))))


def _operand_range(digits: int) -> tuple[int, int]:
    low = 10 ** (digits - 1)
    return low, 10**digits - low  # (first operand, how many operands)


def _sample_indices(rng: random.Random, total: int, k: int, exclude: set[int]) -> list[int]:
    """k distinct indices in [0, total) outside `exclude`, in sampling order."""
    if 2 * (k + len(exclude)) > total:
        # Dense case: rejection sampling would stall, and the space is small enough to list.
        return rng.sample([i for i in range(total) if i not in exclude], k)
    chosen: list[int] = []
    seen = set(exclude)
    while len(chosen) < k:
        i = rng.randrange(total)
        if i not in seen:
            seen.add(i)
            chosen.append(i)
    return chosen


def _row(cfg: DataConfig, a: int, b: int) -> dict:
    # One generator per problem, so a problem's demonstration does not depend on the split sizes.
    rng = random.Random(f"{cfg.seed}:teacher:{a}+{b}")
    metadata = {
        "problem_set": PROBLEM_SET,
        "id": f"add-{a}-{b}",
        "a": a,
        "b": b,
        "carries": count_carries(a, b),
        "demonstrations": [teacher_answer(a, b, cfg.teacher_carry_error, rng) for _ in range(cfg.teacher_samples)],
    }
    return {cfg.input_key: f"{a}+{b}=", cfg.label_key: str(a + b), cfg.metadata_key: metadata}


def make_addition(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows): distinct problems, the two splits disjoint."""
    low, count = _operand_range(cfg.digits)
    total = count * count
    if cfg.train_size + cfg.test_size > total:
        raise ValueError(
            f"data.train_size: {cfg.train_size} train + {cfg.test_size} test problems requested, but only {total} distinct {cfg.digits}-digit additions exist"
        )
    test_idx = _sample_indices(random.Random(f"{cfg.seed}:test"), total, cfg.test_size, set())
    train_idx = _sample_indices(random.Random(f"{cfg.seed}:train"), total, cfg.train_size, set(test_idx))

    def rows(indices: list[int]) -> list[dict]:
        return [_row(cfg, low + i // count, low + i % count) for i in indices]

    return rows(train_idx), rows(test_idx)


def write_jsonl(rows: list[dict], path: str | os.PathLike) -> None:
    """Write one JSON object per line, atomically."""
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# --- "tool_arith": multiplication a tiny model cannot do in its head, but can with the interpreter ---

TOOL_PROBLEM_SET = "tool_arith"


def tool_demonstration(a: int, b: int) -> list[dict]:
    """A conversation solving a*b with the python tool: the call, the tool's output, the answer."""
    product = str(a * b)
    return [
        {"role": "assistant", "content": f"<tool>python\n{a}*{b}\n</tool>"},
        {"role": "tool", "content": product},
        {"role": "assistant", "content": product},
    ]


def _tool_row(cfg: DataConfig, a: int, b: int) -> dict:
    rng = random.Random(f"{cfg.seed}:tool:{a}*{b}")
    demos = [tool_demonstration(a, b) if rng.random() < cfg.tool_demo_fraction else str(a * b) for _ in range(cfg.teacher_samples)]
    metadata = {"problem_set": TOOL_PROBLEM_SET, "id": f"mul-{a}-{b}", "a": a, "b": b, "reward_type": "integer", "demonstrations": demos}
    return {cfg.input_key: f"{a}*{b}=", cfg.label_key: str(a * b), cfg.metadata_key: metadata}


def make_tool_arith(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows) of `digits`-digit products; demonstrations call the python tool
    with probability data.tool_demo_fraction and otherwise answer directly (correctly), so SFT
    starts with some tool use that RL can raise."""
    low, count = _operand_range(cfg.digits)
    total = count * count
    if cfg.train_size + cfg.test_size > total:
        raise ValueError(
            f"data.train_size: {cfg.train_size} train + {cfg.test_size} test problems requested, but only {total} distinct {cfg.digits}-digit products exist"
        )
    test_idx = _sample_indices(random.Random(f"{cfg.seed}:tool-test"), total, cfg.test_size, set())
    train_idx = _sample_indices(random.Random(f"{cfg.seed}:tool-train"), total, cfg.train_size, set(test_idx))
    return tuple([_tool_row(cfg, low + i // count, low + i % count) for i in idx] for idx in (train_idx, test_idx))


def make_problem_set(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """The (train, test) rows of data.problem_set."""
    return make_tool_arith(cfg) if cfg.problem_set == TOOL_PROBLEM_SET else make_addition(cfg)
