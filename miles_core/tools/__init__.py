"""Tools a policy can call during a multi-turn rollout, by name.

Each tool is `tool(argument: str, limits: SandboxLimits) -> (output text, ok)`: it never raises
for anything the model wrote; a failure is reported in the output, as a model would see it.

* `python`: runs the argument as a Python program in the sandbox (tools/sandbox.py); the output
  is what it prints, then, as in an interactive session, the repr of a final expression's
  value (`347*829` prints 287663); on failure, the error's last line and the limit it hit.
* `calc`: evaluates one arithmetic expression (tools/calculator.py).
"""

from __future__ import annotations

from collections.abc import Callable

from miles_core.tools.calculator import CalculatorError, calculate
from miles_core.tools.runs import SandboxLimits
from miles_core.tools.sandbox import run_python

ToolFn = Callable[[str, SandboxLimits], tuple[str, bool]]


# Runs the model's program (a string literal below) like an interactive session: a final
# expression's value is printed. Runs inside the sandbox, so parsing model code is contained too.
_SESSION = """import ast
tree = ast.parse({code!r}, "<tool>", "exec")
last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
scope = {{"__name__": "__main__"}}
exec(compile(tree, "<tool>", "exec"), scope)
if last is not None:
    value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)
    if value is not None:
        print(repr(value))
"""


def python_tool(code: str, limits: SandboxLimits) -> tuple[str, bool]:
    result = run_python(_SESSION.format(code=code), limits)
    return result.summary(), result.ok


def calc_tool(expression: str, limits: SandboxLimits) -> tuple[str, bool]:
    try:
        return str(calculate(expression)), True
    except CalculatorError as err:
        return f"error: {err}", False


TOOLS: dict[str, ToolFn] = {"python": python_tool, "calc": calc_tool}
