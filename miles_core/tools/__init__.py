"""Tools a policy can call during a multi-turn rollout, by name.

Each tool is `tool(argument: str, limits: SandboxLimits) -> (output text, ok)`: it never raises
for anything the model wrote; a failure is reported in the output, as a model would see it.

* `python`: runs the argument as a Python program in the sandbox (tools/sandbox.py); the output
  is what it prints, or its error's last line and the limit it hit.
* `calc`: evaluates one arithmetic expression (tools/calculator.py).
"""

from __future__ import annotations

from typing import Callable

from miles_core.tools.calculator import CalculatorError, calculate
from miles_core.tools.sandbox import SandboxLimits, run_python

ToolFn = Callable[[str, SandboxLimits], tuple[str, bool]]


def python_tool(code: str, limits: SandboxLimits) -> tuple[str, bool]:
    result = run_python(code, limits)
    return result.summary(), result.ok


def calc_tool(expression: str, limits: SandboxLimits) -> tuple[str, bool]:
    try:
        return str(calculate(expression)), True
    except CalculatorError as err:
        return f"error: {err}", False


TOOLS: dict[str, ToolFn] = {"python": python_tool, "calc": calc_tool}
