"""A short real multi-turn RL run of the workflow: SFT on tool demonstrations, then rollouts that
call the sandboxed python tool, scored by the reward hub, trained on, tracked in MLflow."""

from __future__ import annotations

import shutil

import pytest
from mlflow.tracking import MlflowClient

from miles_core.batch_io import read_batch
from miles_core.models.tiny import build_tokenizer
from miles_core.rollout.multi_turn import tool_turn_tokens
from tests.conftest import run_workflow

pytestmark = [pytest.mark.flyte, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing: make setup installs it")]


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("tool")
    out = run_workflow("recipes/tiny_tool_smoke.yaml", base / "runs", base / "home")
    return base / "runs", out


def test_tool_turns_are_masked_in_the_trained_batches(tool_run):
    root, _ = tool_run
    tokenizer = build_tokenizer()
    samples = [s for f in sorted((root / "scored").glob("*.parquet")) for s in read_batch(str(f), scored=True)]
    tool_turns = [(s, t) for s in samples for t in s.metadata["turns"] if t["role"] == "tool"]
    assert tool_turns, "the SFT-started policy made no tool call in any rollout"
    for s in samples:
        spans = [range(t["start"], t["end"]) for t in s.metadata["turns"] if t["role"] == "tool"]
        on_tool = {i for span in spans for i in span}
        assert s.loss_mask == [0 if i in on_tool else 1 for i in range(len(s.response_tokens))]
        assert all(s.rollout_logprobs[i] == 0.0 for i in on_tool)
    for s, t in tool_turns:
        tokens = s.response_tokens[t["start"] : t["end"]]
        output = tokenizer.decode(tokens).split("tool\n", 1)[1].rsplit("<|im_end|>", 1)[0]
        assert tokens == tool_turn_tokens(tokenizer, output)  # the tool turn exactly as framed, encoded once


def test_tool_metrics_reach_mlflow(tool_run):
    root, out = tool_run
    assert "held-out greedy accuracy: before RL" in out.stdout
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny_tool_smoke").experiment_id])
    assert run.info.status == "FINISHED"
    for key in ("rollout_tool_call_rate", "rollout_tool_calls_per_sample", "rollout_turns_per_sample", "reward_accuracy", "eval_accuracy", "time_tools_s"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)][-2:] == [1, 2], key
