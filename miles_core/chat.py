"""Messages -> token ids, through the tokenizer's chat template when it has one.

Every place that turns text into the tokens a policy sees or writes goes through here: the
rollout's prompts (single- and multi-turn), the tool turns a multi-turn rollout appends, and
SFT's demonstrations, so a policy is trained on exactly the layout it generates in.

* `prompt_tokens(tokenizer, prompt)`: the user turn (a text, or a list of chat messages) and the
  opening of the assistant turn (`add_generation_prompt`).
* `response_tokens(tokenizer, text)`: what the model writes after that: the text, then the end of
  turn token (`tokenizer.eos_token_id`, `<|im_end|>` in ChatML), which ends generation.
* `tool_call_end(tokenizer)`: the token that ends a turn calling a tool: the end of turn token, or
  the one the template puts there instead (GLM's `<|observation|>`, harmony's `<|call|>`).
* `tool_turn_tokens(tokenizer, output)`: what follows that token when a tool answered: the
  template's text up to the tool's output, the output, and the opening of the next assistant turn,
  all as the template renders a tool message after an assistant turn. Special token text inside
  the output is encoded as plain bytes, so a tool cannot forge a turn boundary.
* `conversation_tokens(tokenizer, messages)`: a demonstration of assistant and tool turns ->
  (tokens, loss mask 1 exactly on the assistant's tokens and the token ending each of its turns).

A tokenizer without a chat template (a base model's) gets a plain layout: the prompt text as is,
the response followed by the end of turn token, a tool turn as "\\nTool: OUTPUT\\nAssistant: ".
"""

from __future__ import annotations

_SENTINEL = "\x00MILES-CONTENT\x00"  # stands for a message's content while the template is rendered
_TOOL_SENTINEL = "\x00MILES-TOOL\x00"


def _ids(encoded) -> list[int]:
    # apply_chat_template returns a BatchEncoding in transformers 5, a list before
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        encoded = encoded[0]
    return [int(i) for i in encoded]


def _text(tokenizer, text: str, *, plain: bool = False) -> list[int]:
    """Token ids of text; with plain, special-token text is split into ordinary tokens."""
    return [int(i) for i in tokenizer(text, add_special_tokens=False, split_special_tokens=plain)["input_ids"]]


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def end_of_turn(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no eos token: the end of a turn cannot be encoded")
    return int(tokenizer.eos_token_id)


def prompt_tokens(tokenizer, prompt: str | list[dict]) -> list[int]:
    """The prompt (a user text or chat messages) and the opening of the assistant turn."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if has_template(tokenizer):
        return _ids(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    return _text(tokenizer, "\n".join(m["content"] for m in messages))


def response_tokens(tokenizer, text: str) -> list[int]:
    """What the model must generate after `prompt_tokens`: the text, then the end of turn token."""
    return _text(tokenizer, text) + [end_of_turn(tokenizer)]


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _tool_turn_layout(tokenizer) -> tuple[int, str, str]:
    """(token ending a turn that calls a tool, template text after it up to the tool's output, text after the
    output up to the next assistant turn's content), from a conversation rendered with placeholder contents."""
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENTINEL}, {"role": "tool", "content": _TOOL_SENTINEL}]
    between, after = _render(tokenizer, messages, True).split(_SENTINEL, 1)[1].split(_TOOL_SENTINEL, 1)
    first = _text(tokenizer, between)[:1]
    if first and first[0] in tokenizer.all_special_ids:  # the template ends the turn with a token of its own
        token = tokenizer.convert_ids_to_tokens(first[0])
        if between.startswith(token):
            return first[0], between[len(token) :], after
    return end_of_turn(tokenizer), between, after  # no end token rendered: the model's eos ends the turn


def tool_call_end(tokenizer) -> int:
    """The token that ends an assistant turn calling a tool (the end of turn token unless the template says otherwise)."""
    return _tool_turn_layout(tokenizer)[0] if has_template(tokenizer) else end_of_turn(tokenizer)


def tool_turn_tokens(tokenizer, output: str) -> list[int]:
    """Tokens after the model's `tool_call_end`: the template's text before the tool's output, `output`, the next
    assistant opening.  Unpaired surrogates in `output` become '?': the tokenizer takes only UTF-8."""
    output = output.encode("utf-8", "replace").decode("utf-8")
    if not has_template(tokenizer):
        return _text(tokenizer, "\nTool: ") + _text(tokenizer, output, plain=True) + _text(tokenizer, "\nAssistant: ")
    _, before, after = _tool_turn_layout(tokenizer)
    return _text(tokenizer, before) + _text(tokenizer, output, plain=True) + _text(tokenizer, after)


def conversation_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """A demonstration conversation after the prompt -> (response tokens, loss mask).

    `messages` alternate {"role": "assistant" | "tool", "content": text}; assistant turns are
    encoded as the model writes them (mask 1: the text and the token ending the turn, `tool_call_end`
    before a tool turn), tool turns exactly as a multi-turn rollout appends them (mask 0), so SFT and
    rollout see the same token layout.
    """
    tokens, mask = [], []
    for number, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("assistant", "tool") or not isinstance(content, str):
            raise ValueError(f"demonstration message {number}: expected role assistant|tool and text content, got {message!r}")
        calls = role == "assistant" and number + 1 < len(messages) and messages[number + 1].get("role") == "tool"
        if role == "tool":
            turn = tool_turn_tokens(tokenizer, content)
        else:
            turn = _text(tokenizer, content) + [tool_call_end(tokenizer)] if calls else response_tokens(tokenizer, content)
        tokens += turn
        mask += [int(role == "assistant")] * len(turn)
    return tokens, mask
