"""What an async phase leaves, for the sync iterations and phases after it.

* The trainer's checkpoint (backend format) and its weights published as version start + K, stored by the
  trainer actor where the caller says (`run_phase`'s ckpt_out and policy_out).
* Under `out`, on the caller's disk: `batches/step-NNNN.parquet`, every consumed batch, scored, with weight and
  trainer versions; `batches/ledger.json`, where every prompt drawn in the phase ended (data state before and
  after, dropped and filtered draws) and the phase's totals, readable without Flyte; `buffer.parquet`, scored
  groups generated but not consumed (absent when none are left).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from miles_core.async_loop import PhaseResult, PhaseSpec, run_phase
from miles_core.batch_io import write_batch


def run_phase_into(spec: PhaseSpec, out: Path, ckpt_out: str, policy_out: str, batch_shape: dict) -> PhaseResult:
    """Run the phase and write its batches, ledger and buffer under `out` (`batch_shape`: write_batch's checks: scored,
    reward range, vocabulary, group size)."""
    result = run_phase(spec, ckpt_out, policy_out)
    for i, batch in enumerate(result.consumed):
        write_batch(batch, out / "batches" / f"step-{spec.first_iteration + i:04d}.parquet", **batch_shape)
    if result.buffer:
        write_batch([s for g in result.buffer for s in g], out / "buffer.parquet", **batch_shape)
    ledger = {
        "state_before": dataclasses.asdict(spec.state),
        "state_after": dataclasses.asdict(result.state),
        "dropped": result.dropped,
        "filtered": result.filtered,
        "weight_versions": [spec.version, spec.version + spec.steps],
        "metrics": result.metrics,
    }
    (out / "batches" / "ledger.json").write_text(json.dumps(ledger, indent=1))
    return result
