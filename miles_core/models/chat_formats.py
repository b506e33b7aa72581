"""Each model family's prompt format, as a tiny tokenizer carries it: special tokens and a chat template.

The templates are written here (not copied) to reproduce each family's published format: role
markers, the token that ends the model's turn, the generation prompt and how a tool's output is
shown.  The source of each format is named beside it.  They keep what RL needs and leave out what
a tiny policy cannot use: tool declarations, tool-call JSON (the multi-turn rollout writes its calls
as text, miles_core/rollout/multi_turn.py) and reasoning: where a family has a thinking switch the
template is its non-thinking mode.

Every template renders a conversation as the concatenation of what the model reads and what it
writes, so `miles_core.chat` can build prompts, responses and tool turns from it token for token:
an assistant message is rendered exactly as the model generates it, up to and including the token
that ends its turn (`ChatFormat.eos`, or `tool_call_end` where the family ends a turn that calls a
tool with another token).  Published templates differ from that in small ways, named per format:

* GLM has no end-of-turn token: the model stops by writing the next role's marker (`<|user|>`,
  or `<|observation|>` when it calls a tool).  The marker is rendered inside the assistant message
  (the following message does not repeat it), also after the last message.
* harmony (gpt-oss) rewrites a final message's `<|return|>` to `<|end|>` in the history; here it
  stays as generated.  The generation prompt opens the final channel.
* Llama 4 trims message text; here it is kept as written, so the model's tokens are what it wrote.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    """A family's special tokens (ids 0.. in this order), their roles and its chat template."""

    name: str
    special_tokens: tuple[str, ...]
    pad: str
    eos: str  # ends the model's turn (and generation)
    template: str
    bos: str | None = None
    tool_call_end: str | None = None  # ends a turn that calls a tool, where that is not eos


def _t(text: str) -> str:
    """Literal template text as a Jinja expression: no raw text between tags, so the template
    environment's whitespace trimming (trim_blocks, lstrip_blocks) can never eat a newline."""
    return "{{ '" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "' }}"


CONTENT = "{{ m['content'] }}"
ROLE = "{{ m['role'] }}"


def _when(condition: str, then: str, otherwise: str = "") -> str:
    return "{% if " + condition + " %}" + then + ("{% else %}" + otherwise if otherwise else "") + "{% endif %}"


def _after(*roles: str) -> str:
    """The message before this one has one of `roles`."""
    return f"(loop.previtem is defined and loop.previtem['role'] in {roles!r})"


def _before(role: str) -> str:
    """The message after this one has `role`."""
    return f"(loop.nextitem is defined and loop.nextitem['role'] == {role!r})"


def _template(by_role: dict[str, str], other: str, generation_prompt: str, head: str = "") -> str:
    """`head`, then each message rendered by its role (`other` for the rest), then the generation prompt when asked."""
    cases = "".join(("{% if " if i == 0 else "{% elif ") + f"m['role'] == {role!r} %}}" + text for i, (role, text) in enumerate(by_role.items()))
    message = cases + "{% else %}" + other + "{% endif %}" if by_role else other
    return head + "{% for m in messages %}" + message + "{% endfor %}" + _when("add_generation_prompt", generation_prompt)


# Qwen2/Qwen3 ChatML without an implicit default system turn (the prompts carry none); the tool
# role is ChatML's plain role header.  Kept byte for byte: the main recipes' tiny models use it.
CHATML = ChatFormat(
    name="chatml",
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    pad="<|endoftext|>",
    eos="<|im_end|>",
    template=(
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
)


def _qwen(think: str, always_system: bool, tool_tail: str) -> str:
    """ChatML as Qwen3 renders tools: consecutive tool outputs share one user turn, each in
    <tool_response> tags.  `think` opens every assistant turn (the non-thinking mode's empty block)."""
    tool = _when(f"not {_after('tool')}", _t("<|im_start|>user")) + _t("\n<tool_response>\n") + CONTENT + _t(tool_tail)
    tool += _when(f"not {_before('tool')}", _t("<|im_end|>\n"))
    answer = _t("<|im_start|>assistant\n" + think)
    system = _when("messages[0]['role'] != 'system'", _t("<|im_start|>system\n<|im_end|>\n")) if always_system else ""
    other = _t("<|im_start|>") + ROLE + _t("\n") + CONTENT + _t("<|im_end|>\n")
    return _template({"tool": tool, "assistant": answer + CONTENT + _t("<|im_end|>\n")}, other, answer, head=system)


_QWEN_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_QWEN_VISION = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen3.5 (model card, "non-thinking mode": enable_thinking=False opens the turn with an empty think block).
QWEN3_5 = ChatFormat("qwen3_5", _QWEN_TOKENS + _QWEN_VISION, "<|endoftext|>", "<|im_end|>", _qwen("<think>\n\n</think>\n\n", False, "\n</tool_response>"))
# Qwen3-Next-80B-A3B-Instruct (model card: an instruct model, no thinking block).
QWEN3_NEXT = ChatFormat("qwen3_next", _QWEN_TOKENS, "<|endoftext|>", "<|im_end|>", _qwen("", False, "\n</tool_response>"))
# NVIDIA Nemotron 3 Nano (model card, reasoning off): ChatML, an always-present system turn, `<think></think>` before
# every answer, tool outputs in a user turn with a newline before the turn's end.
NEMOTRON_H = ChatFormat(
    "nemotron_h", ("<unk>", "<s>", "</s>") + _QWEN_TOKENS[1:], "<unk>", "<|im_end|>", _qwen("<think></think>", True, "\n</tool_response>\n"), bos="<s>"
)


def _deepseek(answer: str, tools_open: str, tool_open: str, tool_close: str, tools_close: str) -> str:
    """DeepSeek: BOS, the system prompt as plain text, then `<｜User｜>`/`<｜Assistant｜>` turns, each answer ended
    by `<｜end▁of▁sentence｜>`; tool outputs follow that end directly and the model continues after them
    without a new assistant marker."""
    system = _t("<｜begin▁of▁sentence｜>") + "{% for m in messages if m['role'] == 'system' %}" + CONTENT + "{% endfor %}"
    tool = _when(f"not {_after('tool')}", _t(tools_open)) + _t(tool_open) + CONTENT + _t(tool_close) + _when(f"not {_before('tool')}", _t(tools_close))
    cases = {
        "user": _t("<｜User｜>") + CONTENT,
        "assistant": _when(f"not {_after('tool')}", _t(answer)) + CONTENT + _t("<｜end▁of▁sentence｜>"),
        "tool": tool,
    }
    return _template(cases, "", _when("messages[-1]['role'] != 'tool'", _t(answer)), head=system)


_DEEPSEEK_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")
_DEEPSEEK_TOOLS = ("<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")

# DeepSeek-V3 (its tokenizer_config.json chat template; tool outputs grouped in <｜tool▁outputs▁begin｜>...end).
DEEPSEEK_V3 = ChatFormat(
    "deepseek_v3",
    _DEEPSEEK_TOKENS + _DEEPSEEK_TOOLS,
    "<｜▁pad▁｜>",
    "<｜end▁of▁sentence｜>",
    _deepseek("<｜Assistant｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁outputs▁end｜>"),
    bos="<｜begin▁of▁sentence｜>",
)
# DeepSeek-V3.1 non-thinking mode (model card: `<｜Assistant｜></think>`, each tool output on its own), which
# V3.2-Exp ships unchanged; used for V3.2 and V4, whose own templates could not be read here (offline).
DEEPSEEK_V3_1 = ChatFormat(
    "deepseek_v3_1",
    _DEEPSEEK_TOKENS + _DEEPSEEK_TOOLS[2:],
    "<｜▁pad▁｜>",
    "<｜end▁of▁sentence｜>",
    _deepseek("<｜Assistant｜></think>", "", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", ""),
    bos="<｜begin▁of▁sentence｜>",
)

# Kimi K2 / K2.5 (moonshotai/Kimi-K2-Instruct chat template; K2.5 instant mode closes an empty think block):
# a default system turn, `<|im_user|>user<|im_middle|>...<|im_end|>`, tool outputs as a `tool` system turn.
_KIMI_ANSWER = "<|im_assistant|>assistant<|im_middle|><think></think>"
_KIMI_SYSTEM = _when("messages[0]['role'] != 'system'", _t("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"))
_KIMI_TOOL = _t("<|im_system|>tool<|im_middle|>## Return of ") + "{{ m.get('tool_call_id') or 'tool' }}" + _t("\n")
KIMI_K25 = ChatFormat(
    "kimi_k25",
    ("[BOS]", "[EOS]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<think>", "</think>")
    + ("<|media_start|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>", "<|video_pad|>"),
    "[PAD]",
    "<|im_end|>",
    _template(
        {
            role: opening + CONTENT + _t("<|im_end|>")
            for role, opening in (("user", _t("<|im_user|>user<|im_middle|>")), ("assistant", _t(_KIMI_ANSWER)), ("tool", _KIMI_TOOL))
        },
        _t("<|im_system|>") + ROLE + _t("<|im_middle|>") + CONTENT + _t("<|im_end|>"),
        _t(_KIMI_ANSWER),
        head=_KIMI_SYSTEM,
    ),
    bos="[BOS]",
)


def _glm(newline: str, think: str) -> str:
    """GLM: `[gMASK]<sop>`, role markers and no end-of-turn token; consecutive tool outputs share one
    `<|observation|>`.  The marker that ends an assistant turn is rendered with it (module docstring)."""
    cases = {
        "assistant": _t("<|assistant|>" + think) + CONTENT + _when(_before("tool"), _t("<|observation|>"), _t("<|user|>")),
        "tool": _when(f"not {_after('tool', 'assistant')}", _t("<|observation|>"))
        + _t(f"{newline}<tool_response>{newline}")
        + CONTENT
        + _t(f"{newline}</tool_response>"),
        "user": _when(f"not {_after('assistant')}", _t("<|user|>")) + _t(newline) + CONTENT,
    }
    return _template(cases, _t("<|") + ROLE + _t("|>" + newline) + CONTENT, _t("<|assistant|>" + think), head=_t("[gMASK]<sop>"))


_GLM_TOKENS = ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>")
_GLM_TOKENS += ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_GLM_VISION = ("<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|image|>", "<|video|>")

# GLM-4.5 (zai-org/GLM-4.5 chat template, enable_thinking=False: `<|assistant|>\n<think></think>\n`).
GLM4_5 = ChatFormat("glm4_5", _GLM_TOKENS, "<|endoftext|>", "<|user|>", _glm("\n", "\n<think></think>\n"), tool_call_end="<|observation|>")
# GLM-4.7 / GLM-5 (zai-org/GLM-4.7 chat template, no newlines after markers; non-thinking `<|assistant|></think>`).
GLM5 = ChatFormat("glm5", _GLM_TOKENS + _GLM_VISION, "<|endoftext|>", "<|user|>", _glm("", "</think>"), tool_call_end="<|observation|>")

# Llama 4 (meta-llama/Llama-4-Scout-17B-16E-Instruct chat template): `<|header_start|>ROLE<|header_end|>\n\n...<|eot|>`,
# tool outputs under the `ipython` role.
_LLAMA4_TURN = _t("<|header_start|>") + "{{ 'ipython' if m['role'] == 'tool' else m['role'] }}" + _t("<|header_end|>\n\n") + CONTENT + _t("<|eot|>")
LLAMA4 = ChatFormat(
    "llama4",
    ("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad|>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|eom|>")
    + ("<|python_start|>", "<|python_end|>", "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>"),
    "<|finetune_right_pad|>",
    "<|eot|>",
    _template({}, _LLAMA4_TURN, _t("<|header_start|>assistant<|header_end|>\n\n"), head=_t("<|begin_of_text|>")),
    bos="<|begin_of_text|>",
)

# gpt-oss harmony (openai/harmony, "OpenAI Harmony Response Format"): `<|start|>ROLE<|message|>...<|end|>`, the
# answer in the final channel ended by `<|return|>`, a tool call by `<|call|>`, a tool's output from `functions.NAME`.
_FINAL = _t("<|start|>assistant<|channel|>final<|message|>")
HARMONY = ChatFormat(
    "harmony",
    ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"),
    "<|endoftext|>",
    "<|return|>",
    _template(
        {
            "assistant": _FINAL + CONTENT + _when(_before("tool"), _t("<|call|>"), _t("<|return|>")),
            "tool": _t("<|start|>functions.") + "{{ m.get('name') or 'tool' }}" + _t(" to=assistant<|channel|>commentary<|message|>") + CONTENT + _t("<|end|>"),
        },
        _t("<|start|>") + ROLE + _t("<|message|>") + CONTENT + _t("<|end|>"),
        _FINAL,
    ),
    tool_call_end="<|call|>",
)

# MiniMax-M2 (MiniMaxAI/MiniMax-M2 chat template): `]~!b[` then `]~b]ROLE\n...[e~[\n` turns, the assistant role named `ai`,
# consecutive tool outputs in one `tool` turn as <response> elements.  M2 always opens a think block; not here.
_M2_TOOL = _when(f"not {_after('tool')}", _t("]~b]tool")) + _t("\n<response>") + CONTENT + _t("</response>") + _when(f"not {_before('tool')}", _t("[e~[\n"))
MINIMAX_M2 = ChatFormat(
    "minimax_m2",
    ("]~!b[", "]~b]", "[e~[", "]!d~[", "]!p~[", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"),
    "]!p~[",
    "[e~[",
    _template(
        {"tool": _M2_TOOL},
        _t("]~b]") + "{{ 'ai' if m['role'] == 'assistant' else m['role'] }}" + _t("\n") + CONTENT + _t("[e~[\n"),
        _t("]~b]ai\n"),
        head=_t("]~!b["),
    ),
    bos="]~!b[",
)
