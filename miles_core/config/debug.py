"""debug: what a run exports for reading, besides what it trains on (docs/debug.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DebugConfig:
    # every train step also writes its batch as a readable dataset (miles_core/dump.py): prompt and response text,
    # reward, per-token advantages, rollout and trainer log-probs, as parquet and JSONL under <run_root>/dump/
    dump_rollouts: bool = False
