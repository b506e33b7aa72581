"""Helpers of the megatron tests: run tests/megatron_worker.py in its own process(es), read its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = str(REPO / "tests" / "megatron_worker.py")


def run_worker(*args, nproc: int = 0) -> dict:
    """nproc 0: plain python (a world of one); else torchrun with nproc processes on gloo."""
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"] if nproc else [sys.executable]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run([*launcher, WORKER, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT ") :])
