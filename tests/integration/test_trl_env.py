"""TRL itself reads bench/vs_trl.py's mapping as our step: GRPOConfig of TRL 1.16, in TRL's own environment (created
by the benchmark once per machine), built from the main recipe's settings, generates 64 prompts x 8 completions per
batch and takes 2 optimizer steps of 256 completions on it, as train.mini_batches = 2 does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.config import load_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import vs_trl  # noqa: E402 (a benchmark script, importable from its own folder)

pytestmark = pytest.mark.integration

DERIVED = """
import json, sys
from trl import GRPOConfig
args = GRPOConfig(output_dir=sys.argv[2], use_cpu=True, report_to="none", **json.loads(sys.argv[1]))
print(json.dumps([args.generation_batch_size, args.steps_per_generation, args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size]))
"""


def test_trl_generates_our_batch_and_takes_our_optimizer_steps(tmp_path):
    try:
        python, _ = vs_trl.trl_env()
    except subprocess.CalledProcessError as err:
        pytest.skip(f"TRL's environment is absent and cannot be set up here (no package index?): {err}")
    settings = vs_trl.trl_settings(load_recipe("recipes/tiny_arith_cpu.yaml"))
    out = subprocess.run([str(python), "-c", DERIVED, json.dumps(settings), str(tmp_path)], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == [64 * 8, 2, 256]
