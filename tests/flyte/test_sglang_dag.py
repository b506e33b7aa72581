"""The whole workflow with rollout and evaluation in a real SGLang server (recipes/smoke_sglang.yaml).

One `pyflyte run`: the first rollout task starts the server, every later rollout and evaluation
task of the run reuses it (one process in local execution), each new policy version reaches it
over a gloo process group, and the server is gone when the run ends.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import run_workflow
from tests.integration.test_sglang import sglang_env_python

pytestmark = [pytest.mark.flyte, pytest.mark.integration]


def processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command and "sglang" in command:
            found.append(command[:200])
    return found


def test_workflow_rolls_out_in_sglang_and_publishes_each_version(tmp_path, monkeypatch):
    env_dir = Path(sglang_env_python()).parents[1]
    monkeypatch.setenv("MILES_SGLANG_ENV", str(env_dir))  # the run's HOME is a temporary folder
    root = tmp_path / "runs"
    out = run_workflow("recipes/smoke_sglang.yaml", root, tmp_path / "home", "iterations=2")
    batches = sorted((root / "rollout").glob("*[0-9a-f].parquet"))
    assert len(batches) == 2
    for iteration, batch in enumerate(batches):
        versions = set(pd.read_parquet(batch).weight_version)
        assert versions == {iteration + 1}, f"{batch.name}: samples from versions {versions}"  # SFT publishes v1
    assert "rollout/weight_update_s" in out.stdout + out.stderr  # in the tasks' logged outputs
    assert "held-out accuracy" in out.stdout
    assert processes_mentioning(str(root)) == [], "the run left its SGLang server running"
