"""Rollout engines behind the RolloutEngine protocol, chosen by `rollout.engine`.

torch: the embedded engine (it loads the weights directory in this process, in rollout.dtype), built per call, or with
`shared=True` the process's engine for the same settings, into which each call loads its policy (what a task asks
for: in a local Flyte run all tasks share one process, and a policy of the same architecture loads into the model
built already, TorchEngine._reload).
sglang: SGLang servers over HTTP, started once per process and configuration and reused by every
later call; each call publishes the requested policy version into them.
"""

from __future__ import annotations

from miles_core.config import RolloutConfig
from miles_core.rollout.base import RolloutEngine


def make_engine(cfg: RolloutConfig, policy_dir: str, version: int, base_dir: str | None = None, shared: bool = False, **torch_options) -> RolloutEngine:
    """An engine serving `policy_dir` as `version` (a LoRA adapter: over the base model of `base_dir`); torch_options
    (max_batch_sequences, num_threads) tune the embedded engine and are ignored by servers that batch for themselves.
    shared: the embedded engine of this process for these settings, which an earlier caller may still hold: each call
    loads its own policy into it (SGLang servers are always shared)."""
    if cfg.engine == "sglang":
        # imported only for this engine: it brings the HTTP client and the server launcher
        from miles_core.rollout.engines.sglang_shared import shared_engine

        return shared_engine(cfg.sglang, policy_dir, version, cfg.routing_replay, base_dir, cfg.speculative_tokens)
    import torch  # the torch engine's: a pod that builds no engine (tracking, replay) starts without it

    from miles_core.rollout.engines.torch_engine import TorchEngine

    key = (cfg.dtype, cfg.routing_replay, cfg.speculative_tokens, *sorted(torch_options.items()))
    if shared and key in _SHARED:
        engine = _SHARED[key]
        engine.base_dir = base_dir
        engine.load_weights(policy_dir, version)
        return engine
    engine = TorchEngine(
        policy_dir,
        version,
        dtype=getattr(torch, cfg.dtype),
        record_routing=cfg.routing_replay,
        base_dir=base_dir,
        speculative_tokens=cfg.speculative_tokens,
        **torch_options,
    )
    if shared:
        _SHARED[key] = engine
    return engine


_SHARED: dict[tuple, RolloutEngine] = {}  # make_engine(shared=True)'s embedded engines, by their settings


def weight_update_metrics(engine: RolloutEngine) -> dict[str, float]:
    """The last weight update's metrics (rollout/weight_update_s) of engines that publish into servers."""
    return dict(getattr(engine, "last_update_metrics", {}))
