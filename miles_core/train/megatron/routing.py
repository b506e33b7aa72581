"""Rollout routing replay (R3) in megatron-core's routers: a batch's recorded experts forced on its forward passes.

megatron-core 0.16 gives each MoE router a `RouterReplay` (`moe_enable_routing_replay=True`) that its top-k asks for
the selection.  `RolloutReplay` answers for each router of this rank: the rollout's experts (miles_core/routing.py
layout, packed by `pack` as [b, L, MoE layers x k]) where the batch has them, the router's own top-k where it has
not (-1: the last response token, padding), with the router's scores gathered at the chosen experts (as megatron's
own replay does), and counts how often the router would have chosen them itself.

Token order: a router sees its rank's [s, b] hidden states flattened sequence-major, and under sequence parallel
(TP > 1) only its tensor-parallel rank's contiguous slice of the (padded) sequence; a pipeline stage holds the
routers of its own layers, each the MoE layer it is by its global layer number.
"""

from __future__ import annotations

import contextlib

import torch

from miles_core.checkpoint.hf_megatron import ArchSpec
from miles_core.routing import agreement, check_fits


def _replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay  # optional backend: imported where used

    class RolloutReplay(RouterReplay):
        """A router's replay: the target experts [tokens, k] (-1 = its own choice) while one is set."""

        def __init__(self):  # not RouterReplay's: no entry in its class-level list of instances
            self.target: torch.Tensor | None = None
            self.agreement = (0.0, 0.0)

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            chosen = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if self.target is None:
                return chosen
            target = self.target.to(scores.device)
            indices = torch.where(target >= 0, target, chosen[1])
            common, positions = agreement(chosen[1], target)
            self.agreement = (self.agreement[0] + common, self.agreement[1] + positions)
            return scores.gather(1, indices), indices

    return RolloutReplay


class RoutingReplay:
    """The rollout's routing of each forward pass, handed to this rank's routers."""

    def __init__(self, model: torch.nn.Module, spec: ArchSpec):
        from megatron.core.transformer.moe.router import TopKRouter

        moe_layers = [i + 1 for i in range(spec.num_layers) if spec.is_moe_layer(i)]  # megatron's layer numbers
        self.layers, self.top_k, self.experts = len(moe_layers), spec.moe_top_k, spec.num_experts
        replay = _replay_class()
        self.routers = []  # (router's replay, its MoE layer)
        for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
            router.router_replay = replay()
            self.routers.append((router.router_replay, moe_layers.index(router.layer_number)))

    @contextlib.contextmanager
    def around_forward(self, routing: torch.Tensor | None, length: int):
        """routing [b, L, layers x k] (-1 where none) of a forward over [b, length >= L] tokens (padded on the right for
        sequence parallel), or None: the routers' own choice."""
        if routing is None:
            yield
            return
        from megatron.core import parallel_state

        check_fits(routing, self.layers, self.top_k, self.experts)
        routing = torch.nn.functional.pad(routing, (0, 0, 0, length - routing.shape[1]), value=-1)
        ordered = routing.transpose(0, 1)  # [s, b, ...]: the order of megatron's hidden states
        if parallel_state.get_tensor_model_parallel_world_size() > 1:  # sequence parallel: this rank's slice of s
            ordered = ordered.chunk(parallel_state.get_tensor_model_parallel_world_size())[parallel_state.get_tensor_model_parallel_rank()]
        ordered = ordered.reshape(-1, self.layers, self.top_k)
        for replay, layer in self.routers:
            replay.target = ordered[:, layer]
        try:
            yield
        finally:
            for replay, _ in self.routers:
                replay.target = None

    def agreement(self, reset: bool = False) -> tuple[float, float]:
        """(experts in common, positions replayed) of this rank's routers since the last reset."""
        totals = tuple(sum(replay.agreement[i] for replay, _ in self.routers) for i in (0, 1))
        if reset:
            for replay, _ in self.routers:
                replay.agreement = (0.0, 0.0)
        return totals
