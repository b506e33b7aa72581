"""A group's prompt computed once in the trainer's passes (shared-prefix packing).

GRPO-style algorithms sample n responses to each prompt, and a packed batch holds the prompt n times. Under causal
attention a prompt token's hidden states do not depend on what follows it, so the n copies compute the same thing.
`layout` writes each run of consecutive rows that share a prompt as one row: the prompt once, then every response
after it, each response at the positions it has in its own sequence and attending to the prompt and to its own
earlier tokens only (a 4-D attention mask, position ids). The log-probs and gradients are those of the separate rows
(the prompt's gradients are the sum over its responses, as they are over the copies); the products run over
P + n·T tokens instead of n·(P + T), against a dense masked attention over the longer row. A micro-batch is packed so
only where that costs fewer estimated FLOPs (`PrefixCost`): long prompts with short responses, the math-RL shape, gain
most; long responses over a short prompt keep their own rows.

Only models whose every layer is global softmax attention over HF's 4-D mask and explicit positions can take the
packed rows (`SHARING_FAMILIES`, no sliding window): linear-attention, state-space, sliding-window, chunked and
sparse-indexed attention layers, and multimodal positions, cannot. Either way the outputs come back per sample: `pick`
gathers the response positions' rows of what the model computed at `keep` (HF's `logits_to_keep`: no output head on
prompt positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_core.train.base import PackedBatch

# model types whose decoder layers are all global softmax attention taking HF's 4-D mask and position ids
SHARING_FAMILIES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe", "minimax_m2"})


@dataclass(frozen=True)
class PrefixCost:
    """FLOP estimate of a pass: `token` per token (the products with the weights), `pair` per query-key pair."""

    token: float
    pair: float

    @classmethod
    def of(cls, model: torch.nn.Module) -> PrefixCost | None:
        """The model's costs when it can take packed rows, else None."""
        config = model.config
        if config.model_type not in SHARING_FAMILIES or getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
            return None
        if (
            any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ())
            or getattr(config, "sliding_window", None)
            and getattr(config, "use_sliding_window", True)
        ):
            return None
        embeddings = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
        weights = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
        heads = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        return cls(token=2.0 * weights, pair=4.0 * heads * config.num_hidden_layers)

    def __call__(self, rows: int, length: int) -> float:
        return rows * length * self.token + rows * length * length * self.pair


@dataclass
class Layout:
    """What the model is called with and where each response token's output is."""

    inputs: dict  # input_ids [R, L'], attention_mask [R, L'] or [R, 1, L', L'] (additive), position_ids [R, L'] when packed
    keep: torch.Tensor  # [R, K] positions whose outputs are computed (logits_to_keep)
    pick: torch.Tensor  # [b, T] each response token's row in the [R * K] kept outputs


def plain(batch: PackedBatch) -> Layout:
    """One row per sample; the kept positions are the response tokens' predecessors."""
    b, T = batch.gather_index.shape
    pick = torch.arange(b * T, device=batch.gather_index.device).view(b, T)
    return Layout({"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}, batch.gather_index, pick)


def groups(batch: PackedBatch) -> list[range]:
    """Runs of consecutive rows with the same prompt (same length and tokens)."""
    lengths = batch.prompt_lengths.tolist()
    runs: list[range] = []
    for i, length in enumerate(lengths):
        last = runs[-1] if runs else None
        if last is not None and lengths[last.start] == length and torch.equal(batch.input_ids[last.start, :length], batch.input_ids[i, :length]):
            runs[-1] = range(last.start, i + 1)
        else:
            runs.append(range(i, i + 1))
    return runs


def layout(batch: PackedBatch, cost: PrefixCost | None, dtype: torch.dtype) -> Layout:
    """The packed layout of `batch` when `cost` says it is cheaper than one row per sample, else `plain`; an additive
    mask of `dtype` (the pass's)."""
    if cost is None:
        return plain(batch)
    device, rows = batch.input_ids.device, batch.to(torch.device("cpu"))  # the layout is built on the CPU
    runs = groups(rows)
    prompts = rows.prompt_lengths.tolist()
    responses = rows.response_mask.sum(1).long().tolist()
    packed_length = max(prompts[r.start] + sum(responses[i] for i in r) for r in runs)
    if len(runs) == len(rows) or cost(len(runs), packed_length) >= cost(len(rows), rows.input_ids.shape[1]):
        return plain(batch)
    b, T = rows.gather_index.shape
    width = max(len(r) for r in runs) * T
    input_ids = torch.zeros(len(runs), packed_length, dtype=rows.input_ids.dtype)
    positions = torch.zeros(len(runs), packed_length, dtype=torch.long)
    segment = torch.full((len(runs), packed_length), -2)  # -1: the prompt, k: the run's k-th response, -2: padding
    keep = torch.zeros(len(runs), width, dtype=torch.long)
    pick = torch.zeros(b, T, dtype=torch.long)
    for g, run in enumerate(runs):
        P = prompts[run.start]
        input_ids[g, :P], positions[g, :P], segment[g, :P] = rows.input_ids[run.start, :P], torch.arange(P), -1
        start = P
        for k, i in enumerate(run):
            R = responses[i]
            span = slice(start, start + R)
            input_ids[g, span], positions[g, span], segment[g, span] = rows.input_ids[i, P : P + R], torch.arange(P, P + R), k
            before = torch.arange(start - 1, start + R - 1)  # the output before each response token: its predecessor's
            before[:1] = P - 1  # and the first one's predecessor is the prompt's last token
            keep[g, k * T : k * T + R] = before
            pick[i] = g * width + k * T + torch.arange(T)
            start += R
    query, key = segment.unsqueeze(2), segment.unsqueeze(1)  # [R, L', 1], [R, 1, L']
    causal = torch.ones(packed_length, packed_length, dtype=torch.bool).tril()
    allowed = causal & ((key == -1) | (query == key))  # padding attends to padding: no row is empty
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)
    inputs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions}
    return Layout({k: v.to(device) for k, v in inputs.items()}, keep.to(device), pick.to(device))
