"""Rollout routing replay (R3): record the experts each token was routed to in rollout, replay them in training.

A mixture-of-experts model routes every token to its top-k experts in each MoE layer.  The rollout engine and the
trainer compute the router's scores with different kernels, precisions or (in the async phase) weights, so near a
tie they choose different experts and the trainer's log-probs stop being those of the policy that sampled.  R3
records the rollout's choice and forces it in training: the router's scores at the recorded experts still give the
gate weights (and their gradients), only the selection is replayed.

Layout (`Sample.routed_experts`, `Generation.routed_experts`): the expert ids of every position the engine fed to
the model (the prompt, then each response token but the last, which is never fed: P + R - 1 positions), flattened
[position, routed layer, k], the layers in model order counting only those that choose experts by top-k (DeepSeek-V4's
hash-routed layer chooses by token id and is left out).  Empty when nothing was recorded.  `pack` spreads it to
[B, L, layers x k] with -1 where nothing was recorded (the last response token, padding): those positions come after
every recorded one, so in a causal model their experts change no log-prob that is trained on.

`RouterTaps` does it for any transformers MoE model: its MoE blocks (a module with an `experts` child) select experts
with `torch.topk` over [tokens, experts] scores with k = the config's experts per token; a `TorchFunctionMode` that
is active only around the model's forward reads that call's indices (record) or answers it with the recorded ones
and the scores gathered there (replay), so each family's own gate arithmetic (softmax then top-k, sigmoid with a
selection bias, renormalisation, scaling) runs unchanged on the replayed experts.
"""

from __future__ import annotations

import contextlib
import functools
import re

import torch
from torch.overrides import TorchFunctionMode

_TOPK = (torch.topk, torch.Tensor.topk)
_EXPERTS_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k")


def moe_sizes(config) -> tuple[int, int]:
    """(routed experts, experts per token) of a transformers text config; (0, 0) for a dense model."""
    experts = next((getattr(config, key) for key in _EXPERTS_KEYS if getattr(config, key, None)), 0)
    top_k = next((getattr(config, key) for key in _TOP_K_KEYS if getattr(config, key, None)), 0)
    return (int(experts), int(top_k)) if experts and top_k else (0, 0)


def moe_layer_ids(config) -> list[int]:
    """The decoder layers with routed experts of a checkpoint's transformers config (a multimodal one's language model),
    as `load_causal_lm` builds the model (on the meta device: no weights): how an SGLang server's per-layer record
    [positions, all layers, k] maps to this layout."""
    from miles_core.models.loading import meta_model  # transformers' model classes: loaded where a layout is asked for

    model = meta_model(config)
    blocks = [name for name, m in model.named_modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)]
    return sorted({int(re.search(r"layers\.(\d+)\.", f"{name}.").group(1)) for name in blocks})


def agreement(own: torch.Tensor, replayed: torch.Tensor) -> tuple[float, float]:
    """(experts in common, positions) of own and replayed choices [N, k] over the rows replayed (>= 0): the share of
    each position's k experts that the model would have chosen itself, summed."""
    known = replayed[:, 0] >= 0
    own, replayed = own[known], replayed[known]
    common = (own[:, :, None] == replayed[:, None, :]).any(-1).float().mean(-1)  # [n]
    return float(common.sum()), float(known.sum())


def prefix(routed: list[int], fed: int, keep: int) -> list[int]:
    """The routing of the first `keep` positions of a record over `fed` positions (a response cut short)."""
    return routed[: keep * (len(routed) // fed)] if routed else []


def check_fits(routing: torch.Tensor, layers: int, top_k: int, experts: int) -> None:
    """Refuse a batch's routing [.., layers x k] that this model cannot replay (layer count, top-k, expert ids)."""
    width = routing.shape[-1]
    if width != layers * top_k:
        raise ValueError(
            f"routing replay: the batch records {width} expert ids per token, this model routes {layers} layers x top-{top_k} = "
            f"{layers * top_k} (was the rollout engine serving another model?)"
        )
    if routing.numel() and int(routing.max()) >= experts:
        raise ValueError(f"routing replay: the batch names expert {int(routing.max())}, this model has {experts} (ids 0..{experts - 1})")


class RouterTaps(TorchFunctionMode):
    """Records or replays the top-k selection of a transformers MoE model's routed layers.

    taps = RouterTaps(model)
    with taps.recording():            # each forward's choices, taken after it
        model(...); choice = taps.take()           # [tokens, layers, k]
    with taps.replaying(routing):     # routing [b, s, layers x k] of the forward's [b, s] input, -1 = its own
        model(...)                    # taps.agreement: (experts in common, positions) so far
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.experts, self.top_k = moe_sizes(model.config.get_text_config(decoder=True))
        if not self.experts:
            raise ValueError(f"routing replay needs a mixture-of-experts model; {type(model).__name__} has no routed experts")
        blocks = [m for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)]
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(functools.partial(self._enter, index))
            block.register_forward_hook(self._leave)
        self._block: int | None = None
        self._chosen: dict[int, torch.Tensor] = {}
        self._target: torch.Tensor | None = None
        self.column = {}  # block index -> routed layer: found by routing one token
        self.agreement = (0.0, 0.0)
        with self.recording(), torch.no_grad():
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=next(model.parameters()).device), use_cache=False)
        self.column = {block: layer for layer, block in enumerate(sorted(self._chosen))}
        self._chosen = {}
        self.layers = len(self.column)

    def _enter(self, index: int, module, args) -> None:
        self._block = index

    def _leave(self, module, args, output) -> None:
        self._block = None

    @contextlib.contextmanager
    def recording(self):
        self._chosen, self._target = {}, None
        with self:
            yield

    @contextlib.contextmanager
    def replaying(self, routing: torch.Tensor):
        check_fits(routing, self.layers, self.top_k, self.experts)
        self._target = routing.reshape(-1, self.layers, self.top_k)
        try:
            with self:
                yield
        finally:
            self._target = None

    def take(self) -> torch.Tensor:
        """The last forward's choices [tokens, layers, k] (tokens: its [b, s] input flattened)."""
        if sorted(self._chosen) != sorted(self.column):
            raise RuntimeError(f"routing replay: the forward routed blocks {sorted(self._chosen)}, expected {sorted(self.column)}")
        chosen = torch.stack([self._chosen[block] for block in sorted(self._chosen)], dim=1)
        self._chosen = {}
        return chosen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._block is None or func not in _TOPK or not self._routes(args, kwargs):
            return out
        if self._target is None:
            if self._block in self._chosen:
                raise RuntimeError(f"routing replay: MoE block {self._block} selects its experts with more than one top-k over [tokens, experts]")
            self._chosen[self._block] = out[1]
            return out
        target = self._target[:, self.column[self._block]].to(out[1].device)  # [tokens, k]
        if target.shape[0] != out[1].shape[0]:
            raise ValueError(f"routing replay: {target.shape[0]} recorded positions for a forward over {out[1].shape[0]} tokens")
        indices = torch.where(target >= 0, target, out[1])
        common, positions = agreement(out[1], target)
        self.agreement = (self.agreement[0] + common, self.agreement[1] + positions)
        return torch.return_types.topk((args[0].gather(-1, indices), indices))

    def _routes(self, args, kwargs) -> bool:
        """Whether this top-k is the block's expert selection: over [tokens, experts], k = experts per token."""
        scores = args[0]
        k = kwargs.get("k", args[1] if len(args) > 1 else None)
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
        return scores.ndim == 2 and scores.shape[-1] == self.experts and k == self.top_k and dim in (-1, 1)
