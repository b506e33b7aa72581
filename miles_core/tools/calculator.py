"""The calculator tool: arithmetic on numbers, evaluated by walking Python's `ast`, never `eval`.

Allowed: numbers, + - * / // % **, unary + -, parentheses. Anything else (names, calls,
attributes, strings) is rejected with the offending syntax named. Exponents and operand sizes
are bounded so `9**9**9` cannot hang the rollout.
"""

from __future__ import annotations

import ast
import operator

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_DIGITS = 60  # largest intermediate integer, in decimal digits

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic or its value is out of bounds."""


def _bounded(value):
    if isinstance(value, int) and abs(value) >= 10**MAX_DIGITS:
        raise CalculatorError(f"intermediate value has more than {MAX_DIGITS} digits")
    return value


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except (ZeroDivisionError, OverflowError) as err:
            raise CalculatorError(str(err)) from None
    raise CalculatorError(f"not arithmetic: {type(node).__name__}")


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculatorError for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"syntax error: {err.msg}") from None
    except (ValueError, UnicodeError):  # NUL bytes (older Pythons), unpaired surrogates
        raise CalculatorError("not plain text (NUL byte or unpaired surrogate)") from None
    value = _evaluate(tree)
    if isinstance(value, complex):
        raise CalculatorError("complex result")
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value
