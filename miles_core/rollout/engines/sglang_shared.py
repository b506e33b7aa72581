"""One set of SGLang servers per configuration in this process, reused by every rollout that asks for it.

A local Flyte run executes every task in one process: each iteration's rollout finds the servers the first one
launched and publishes its policy version into them (a server start costs tens of seconds). On a cluster each pod
holds its own set. Every set is closed when the process exits.
"""

from __future__ import annotations

import atexit

from miles_core.config import SGLangConfig, config_hash
from miles_core.rollout.engines.sglang import SGLangEngine
from miles_core.weights.adapter import is_adapter_dir

_SHARED: dict[str, SGLangEngine] = {}


def shared_engine(
    cfg: SGLangConfig, policy_dir: str, version: int, record_routing: bool = False, base_dir: str | None = None, speculative_tokens: int = 0
) -> SGLangEngine:
    """The engine of this process for `cfg`, started on first use, serving `version` on return (a LoRA adapter over the
    base model of `base_dir`)."""
    key = f"{config_hash(cfg)}-{record_routing}-{speculative_tokens}"
    engine = _SHARED.get(key)
    if engine is not None and engine.lora != is_adapter_dir(policy_dir):  # the first adapter of a LoRA run: its
        _SHARED.pop(key).close()  # servers run the base with --enable-lora, launched anew (a pod's GPUs hold one set)
        engine = None
    if engine is None:
        engine = _SHARED[key] = SGLangEngine(cfg, policy_dir, version, record_routing, base_dir, speculative_tokens)
    else:
        engine.load_weights(policy_dir, version)
    return engine


@atexit.register
def close_shared_engines() -> None:
    while _SHARED:
        _SHARED.popitem()[1].close()
