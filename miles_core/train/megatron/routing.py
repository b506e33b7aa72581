"""MoE router replay through the trainer: record the experts each token was routed to, replay them.

megatron-core 0.16 (`moe_enable_routing_replay=True`) gives every MoE router a `RouterReplay`
instance; this wraps its global switches for our trainer API.  A record is one entry per
forward micro-batch, each a list with one [tokens, top_k] index tensor per MoE layer of this rank
(in the routers' creation order): the shape rollout engines report routed experts in, which the
rollout-routing-replay work feeds back through `replay`.
"""

from __future__ import annotations

import contextlib


class RoutingReplay:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.mode = "off"  # off | record | replay
        self.recorded: list[list] = []
        self._pending: list[list] = []

    def record(self) -> None:
        """Record the routing of the following forward passes (read them from `recorded`)."""
        self._require()
        self.mode, self.recorded = "record", []

    def replay(self, decisions: list[list]) -> None:
        """Route the following forward passes as `decisions` (one entry per forward micro-batch)."""
        self._require()
        self.mode, self._pending = "replay", list(decisions)

    def stop(self) -> None:
        self.mode, self._pending = "off", []

    def _require(self) -> None:
        if not self.enabled:
            raise ValueError("routing replay needs an MoE model (qwen3_moe)")

    @contextlib.contextmanager
    def around_forward(self):
        if self.mode == "off":
            yield
            return
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction  # optional backend

        if self.mode == "replay":
            if not self._pending:
                raise ValueError("routing replay: more forward passes than recorded decisions")
            RouterReplay.set_replay_data(self._pending.pop(0))
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD if self.mode == "record" else RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            if self.mode == "record":
                self.recorded.append([t.clone() for t in RouterReplay.get_recorded_data()])
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_indices()
