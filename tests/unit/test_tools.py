"""The calculator (ast walking, no eval), the tools' contract, and the tool_arith problem set with
its multi-turn SFT demonstrations."""

from __future__ import annotations

import shutil

import pytest

from miles_core.config import ConfigError, DataConfig
from miles_core.data.problems import make_problem_set, tool_demonstration
from miles_core.data.source import Prompt
from miles_core.models.tiny import build_tokenizer
from miles_core.tools import TOOLS
from miles_core.tools.calculator import CalculatorError, calculate
from miles_core.tools.runs import SandboxLimits, SandboxResult
from miles_core.train.sft import demonstrations


@pytest.mark.parametrize("expression,value", [("347*829", 287663), ("(1+2)*3 - 4/2", 7), ("2**10", 1024), ("-7 // 2", -4), ("7 % 3", 1), ("1/4", 0.25)])
def test_calculator_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression,reason",
    [
        ("__import__('os').system('id')", "not arithmetic: Call"),
        ("x + 1", "not arithmetic: Name"),
        ("'a' * 3", "not arithmetic: Constant"),
        ("9**9**9", "exponent"),
        ("10**59 * 10**59", "digits"),
        ("1/0", "division by zero"),
        ("1 +", "syntax error"),
        ("1" * 300, "longer than"),
    ],
)
def test_calculator_rejects_what_is_not_bounded_arithmetic(expression, reason):
    with pytest.raises(CalculatorError, match=reason):
        calculate(expression)


def test_tools_report_failures_as_output():
    assert TOOLS["calc"]("2*3", SandboxLimits()) == ("6", True)
    output, ok = TOOLS["calc"]("open('/etc/passwd')", SandboxLimits())
    assert not ok and output.startswith("error: not arithmetic")


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing: make setup installs it")
def test_python_tool_prints_and_reports_errors():
    assert TOOLS["python"]("print(347*829)", SandboxLimits()) == ("287663\n", True)
    assert TOOLS["python"]("x = 347\nx * 829", SandboxLimits()) == ("287663\n", True)  # a final expression is shown
    assert TOOLS["python"]("None", SandboxLimits()) == ("", True)
    output, ok = TOOLS["python"]("1/0", SandboxLimits())
    assert not ok and "ZeroDivisionError" in output


def test_tool_arith_problem_set():
    cfg = DataConfig(problem_set="tool_arith", digits=3, train_size=50, test_size=10, teacher_samples=4, tool_demo_fraction=0.5)
    train, test = make_problem_set(cfg)
    assert len(train) == 50 and len(test) == 10
    assert not {r["input"] for r in train} & {r["input"] for r in test}
    row = train[0]
    a, b = row["metadata"]["a"], row["metadata"]["b"]
    assert row["input"] == f"{a}*{b}=" and row["label"] == str(a * b) and 100 <= a <= 999
    demos = [d for r in train for d in r["metadata"]["demonstrations"]]
    tool_share = sum(isinstance(d, list) for d in demos) / len(demos)
    assert 0.3 < tool_share < 0.7 and make_problem_set(cfg) == (train, test)
    with pytest.raises(ConfigError, match="data.problem_set"):
        DataConfig(problem_set="multiplication")


def test_sft_masks_the_tool_turn_of_a_demonstration():
    tokenizer = build_tokenizer()
    conversation = tool_demonstration(12, 34)
    [tool_demo, direct] = demonstrations([Prompt("p", "12*34=", "408", {"demonstrations": [conversation, "408"]})], tokenizer)
    trained = tokenizer.decode([t for t, m in zip(tool_demo.response_tokens, tool_demo.loss_mask) if m])
    masked = tokenizer.decode([t for t, m in zip(tool_demo.response_tokens, tool_demo.loss_mask) if not m])
    assert trained == "<tool>python\n12*34\n</tool><|im_end|>408<|im_end|>"
    assert masked == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    assert direct.loss_mask == [1] * len(direct.response_tokens)


def test_a_failed_programs_summary_names_the_error_when_its_children_interleave_their_tracebacks():
    """A fork bomb's processes write their tracebacks to one pipe: the summary still gives the
    error's line, not whichever frame line came last."""
    traceback = [
        "Traceback (most recent call last):",
        '  File "/code/main.py", line 5, in <module>',
        "BlockingIOError: [Errno 11] Resource temporarily unavailable",
    ]
    interleaved = "\n".join([*traceback, traceback[0], traceback[1], "    exec(compile(tree, '<tool>', 'exec'), scope)", ""])
    result = SandboxResult("error", 1, "", interleaved, 0.1)
    assert result.summary() == "BlockingIOError: [Errno 11] Resource temporarily unavailable\n[error]"
    assert SandboxResult("crashed", 139, "partial\n", "  indented only\n", 0.1).summary() == "partial\n  indented only\n[crashed] crashed (exit 139)"
    # stopped at the output limit: the last line may be cut mid-way, the last whole one is named
    cut = SandboxResult("output_limit", -9, "", interleaved + "BlockingIOError: [Errno 11] Res", 0.1)
    assert cut.summary() == "BlockingIOError: [Errno 11] Resource temporarily unavailable\n[output_limit] output limit reached"
    assert SandboxResult("output_limit", -9, "", "no line break at all", 0.1).summary() == "no line break at all\n[output_limit] output limit reached"
