"""What a local run keeps in the workflow's process does not compound over iterations: each iteration adds the same
decks (those its score and train tasks make), so a long run holds a multiple of one iteration's, never a doubling list
(every forked Elastic worker once handed back the decks it inherited: 12 GB by iteration 16 of `make run`)."""

import subprocess

import pytest

from tests.conftest import REPO, workflow_command, workflow_env

pytestmark = pytest.mark.flyte

ITERATIONS = 6


def test_every_iteration_adds_the_same_decks_to_the_workflows_process(tmp_path):
    seen = tmp_path / "decks_seen"
    command = workflow_command("recipes/smoke.yaml", tmp_path / "runs", f"iterations={ITERATIONS}", "data.source_fn=tests.flyte.decks_seen:counting_source")
    env = {**workflow_env(tmp_path / "home"), "DECKS_SEEN": str(seen)}
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    held = [int(line) for line in seen.read_text().split()]  # when each iteration's rollout starts
    assert len(held) == ITERATIONS
    added = {after - before for before, after in zip(held, held[1:])}
    assert len(added) == 1 and 0 < added.pop() <= 16, held  # score's and train's decks, the same count every iteration
