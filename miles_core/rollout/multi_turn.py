"""Multi-turn generation with tools: a second implementation of the `rollout.generate_fn` plug-point.

The conversation is rendered by the tokenizer's chat template (miles_core/chat.py; ChatML for the
tiny models). The model writes an assistant turn, ended by its end of turn token as usual.
If that turn holds a tool call, written as

    <tool>NAME
    ARGUMENT</tool>

(NAME one of rollout.multi_turn.tools; the first call of a turn counts), the tool runs and its
output is appended as a tool turn (`chat.tool_turn_tokens`), then a new assistant turn opens.  Where
the template ends a tool-calling turn with a token of its own (`chat.tool_call_end`: GLM's
`<|observation|>`, harmony's `<|call|>`), generation also stops there, and only a turn ended by it
calls a tool: one ended by the end of turn token is the answer.  In ChatML:

    <|im_end|>  \\n<|im_start|>tool\\nOUTPUT<|im_end|>\\n<|im_start|>assistant\\n   (tool tokens)

and generation continues from the whole conversation. A turn without a tool call is the answer.
Generation also ends at rollout.multi_turn.max_turns assistant turns or when the response
reaches rollout.multi_turn.max_response_tokens tokens (model and tool tokens together).

Token in, token out: the model's tokens are kept exactly as the engine generated them (its text
is decoded only to look for a tool call, never encoded again); only the tool turn is encoded, once,
with special tokens in the tool's output split into plain bytes so a tool cannot forge a turn
boundary. The sample's response is all turns concatenated; `loss_mask` is 1 exactly on the
model's tokens, the tool tokens have mask 0 and log-prob 0. `metadata["turns"]` records each
turn (role, token span, weight version, tool name and status), `metadata["stop_reason"]` why the
conversation ended (answer | max_turns | token_budget | turn_length).
"""

from __future__ import annotations

import dataclasses
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from miles_core.chat import end_of_turn, prompt_tokens, tool_call_end, tool_turn_tokens
from miles_core.config import MultiTurnConfig, RolloutConfig
from miles_core.data.source import Prompt
from miles_core.rollout.base import FINISH_LENGTH, FINISH_STOP, Generation, RolloutEngine, SamplingParams
from miles_core.routing import prefix
from miles_core.samples import Sample
from miles_core.tools import TOOLS
from miles_core.tools.runs import SandboxLimits

TOOL_CALL = re.compile(r"<tool>([A-Za-z_][A-Za-z0-9_-]*)\n(.*?)</tool>", re.DOTALL)


def parse_tool_call(text: str) -> tuple[str, str] | None:
    """(tool name, argument) of the first tool call in an assistant turn's text, else None."""
    match = TOOL_CALL.search(text)
    return (match.group(1), match.group(2)) if match else None


@dataclass
class Conversation:
    """One sample's growing response: all turns after the prompt."""

    prompt: Prompt
    index: int
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    stop_reason: str = ""
    routed_experts: list[int] = field(default_factory=list)  # of the last model turn's call: every position it fed

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    def add_model_turn(self, g: Generation, budget: int) -> list[int]:
        """Append the generated tokens (cut at the token budget); returns the tokens kept."""
        kept = g.tokens[: budget - len(self.tokens)]
        fed = len(self.prompt_tokens) + len(self.tokens) + len(g.tokens) - 1
        self.routed_experts = prefix(g.routed_experts, fed, fed - len(g.tokens) + len(kept))
        self.turns.append({"role": "assistant", "start": len(self.tokens), "end": len(self.tokens) + len(kept), "weight_version": g.weight_version})
        self.tokens += kept
        self.logprobs += g.logprobs[: len(kept)]
        self.mask += [1] * len(kept)
        if len(kept) < len(g.tokens) or (len(self.tokens) >= budget and g.finish_reason == FINISH_LENGTH):
            self.stop_reason = "token_budget"
        elif g.finish_reason == FINISH_LENGTH:
            self.stop_reason = "turn_length"
        return kept

    def add_tool_turn(self, tokens: list[int], name: str, ok: bool, budget: int) -> None:
        self.turns[-1]["tool"] = name
        if len(self.tokens) + len(tokens) >= budget:  # no room left for an answer after the output
            self.stop_reason = "token_budget"
            return
        self.turns.append({"role": "tool", "start": len(self.tokens), "end": len(self.tokens) + len(tokens), "tool": name, "ok": ok})
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.mask += [0] * len(tokens)
        self.routed_experts = []  # the next model turn's call feeds these; without one the trainer routes this sample itself

    def sample(self) -> Sample:
        versions = [t["weight_version"] for t in self.turns if t["role"] == "assistant"]
        return Sample(
            prompt_id=self.prompt.id,
            index=self.index,
            prompt_tokens=self.prompt_tokens,
            response_tokens=self.tokens,
            rollout_logprobs=self.logprobs,
            loss_mask=self.mask,
            finish_reason=FINISH_STOP if self.stop_reason == "answer" else FINISH_LENGTH,
            weight_version=min(versions),
            label=self.prompt.label,
            metadata={**self.prompt.metadata, "turns": self.turns, "stop_reason": self.stop_reason},
            routed_experts=self.routed_experts,
        )


def _limits(settings: MultiTurnConfig) -> SandboxLimits:
    return SandboxLimits(
        wall_s=settings.tool_timeout_s,
        cpu_s=settings.tool_cpu_s,
        memory_mb=settings.tool_memory_mb,
        max_output_bytes=max(4 * settings.max_tool_output_chars, 4096),
    )


def _run_tool(call: tuple[str, str], allowed: list[str], limits: SandboxLimits, max_chars: int) -> tuple[str, bool]:
    name, argument = call
    if name not in allowed:
        shown = name if len(name) <= 40 else name[:37] + "..."
        return f"error: unknown tool {shown!r} (available: {', '.join(allowed)})", False
    output, ok = TOOLS[name](argument, limits)
    output = output.strip()
    return (output[:max_chars] + " ...[cut]" if len(output) > max_chars else output), ok


def _tools_of(settings: MultiTurnConfig) -> list[str]:
    names = [t.strip() for t in settings.tools.split(",")]
    unknown = [t for t in names if t not in TOOLS]
    if unknown:
        raise ValueError(f"rollout.multi_turn.tools: unknown tool(s) {unknown} (available: {', '.join(TOOLS)})")
    return names


def _take_turn(active: list[Conversation], generations, tokenizer, settings: MultiTurnConfig, last_turn: bool) -> list[tuple[Conversation, tuple[str, str]]]:
    """Append each generated turn; returns the conversations whose turn called a tool."""
    calls = []
    answer_end = end_of_turn(tokenizer) if tool_call_end(tokenizer) != end_of_turn(tokenizer) else None
    for conv, (g,) in zip(active, generations):
        kept = conv.add_model_turn(g, settings.max_response_tokens)
        if conv.done:
            continue
        ended_as_answer = answer_end is not None and kept[-1:] == [answer_end]
        call = None if ended_as_answer else parse_tool_call(tokenizer.decode(kept, skip_special_tokens=True))
        if call is None:
            conv.stop_reason = "answer"
        elif last_turn:
            conv.stop_reason = "max_turns"
        else:
            calls.append((conv, call))
    return calls


def generate(
    engine: RolloutEngine, prompts: list[Prompt], tokenizer, params: SamplingParams, rollout_cfg: RolloutConfig | None = None
) -> tuple[list[Sample], dict]:
    """Plug-point `rollout.generate_fn` (signature of `miles_core.step.generate`), multi-turn with tools.

    `rollout_cfg.multi_turn` holds the turn and tool settings (defaults when not given);
    params.max_new_tokens caps each assistant turn. Returns params.n samples per prompt, grouped
    by prompt, and rollout metrics including rollout/tool_call_rate.
    """
    started = time.perf_counter()
    settings = rollout_cfg.multi_turn if rollout_cfg is not None else MultiTurnConfig()
    allowed, limits = _tools_of(settings), _limits(settings)
    convs = [Conversation(p, i, prompt_tokens(tokenizer, p.text)) for p in prompts for i in range(params.n)]
    stops = tuple(dict.fromkeys((*params.stop_token_ids, tool_call_end(tokenizer))))  # the end of a tool-calling turn stops too
    tool_seconds = 0.0
    with ThreadPoolExecutor(settings.tool_workers) as pool:
        for turn in range(settings.max_turns):
            active = [c for c in convs if not c.done]
            if not active:
                break
            turn_params = dataclasses.replace(params, n=1, seed=params.seed + 104_729 * turn, stop_token_ids=stops)
            generations = engine.generate([c.prompt_tokens + c.tokens for c in active], turn_params)
            calls = _take_turn(active, generations, tokenizer, settings, last_turn=turn == settings.max_turns - 1)
            tool_started = time.perf_counter()
            results = list(pool.map(lambda cc: _run_tool(cc[1], allowed, limits, settings.max_tool_output_chars), calls))
            tool_seconds += time.perf_counter() - tool_started
            for (conv, (name, _)), (output, ok) in zip(calls, results):
                conv.add_tool_turn(tool_turn_tokens(tokenizer, output), name, ok, settings.max_response_tokens)
    samples = [c.sample() for c in convs]
    return samples, _metrics(samples, time.perf_counter() - started, tool_seconds)


def _metrics(samples: list[Sample], seconds: float, tool_seconds: float) -> dict:
    count = len(samples)
    tool_turns = [[t for t in s.metadata["turns"] if t["role"] == "tool"] for s in samples]
    calls = sum(len(t) for t in tool_turns)
    model_tokens = sum(sum(s.loss_mask) for s in samples)
    reasons = ("answer", "max_turns", "token_budget", "turn_length")
    return {
        "rollout/response_length": sum(len(s.response_tokens) for s in samples) / count,
        "rollout/model_tokens": model_tokens / count,
        "rollout/truncated_fraction": sum(s.finish_reason == FINISH_LENGTH for s in samples) / count,
        "rollout/tokens_per_s": model_tokens / max(seconds - tool_seconds, 1e-9),
        "rollout/tool_call_rate": sum(bool(t) for t in tool_turns) / count,
        "rollout/tool_calls_per_sample": calls / count,
        "rollout/tool_error_rate": sum(not x["ok"] for t in tool_turns for x in t) / max(calls, 1),
        "rollout/turns_per_sample": sum(sum(t["role"] == "assistant" for t in s.metadata["turns"]) for s in samples) / count,
        **{f"rollout/stop_{r}": sum(s.metadata["stop_reason"] == r for s in samples) / count for r in reasons},
        "time/tools_s": tool_seconds,
        "time/rollout_s": seconds,
    }
