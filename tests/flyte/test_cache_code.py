"""Cache versions follow the code: a changed plug-in loss re-runs the training step, not the rollout.

Two real local `pyflyte run`s of the smoke recipe (one iteration) with the same Flyte cache, its
`algo.loss_fn` a module this test writes; between them only that module's source changes. Flytekit
logs "Cache hit" or "Cache miss" for every cached task, in the order the tasks run.
"""

import os

import pytest

from tests.conftest import REPO, run_workflow

pytestmark = [pytest.mark.flyte, pytest.mark.integration]

LOSS = '''
from miles_core.algos.objective import policy_loss


def loss(algo, logprobs, entropy, mask, extras):
    """algo.loss_fn: the default policy loss{suffix}."""
    loss, metrics = policy_loss(algo, logprobs, entropy, mask, extras)
    return loss * {scale}, metrics
'''

# the cached tasks in the order one iteration runs them (stage_code, start_run and the logging tasks are not cached)
ORDER = ["base_model", "admit_model", "make_data", "sft", "evaluate", "convert", "rollout", "score", "train", "publish", "evaluate"]


def cache_lines(log: str) -> list[str]:
    return ["hit" if "Cache hit" in line else "miss" for line in log.splitlines() if "Cache hit" in line or "Cache miss" in line]


def test_a_changed_loss_reruns_training_and_keeps_the_rollouts(tmp_path, monkeypatch):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(plugins), str(REPO), os.environ.get("PYTHONPATH", "")]))
    root, home = tmp_path / "runs", tmp_path / "home"
    args = ("iterations=1", "algo.loss_fn=my_loss:loss")

    (plugins / "my_loss.py").write_text(LOSS.format(suffix="", scale="1.0"))
    out = run_workflow("recipes/smoke.yaml", root, home, *args)
    assert cache_lines(out.stdout + out.stderr) == ["miss"] * len(ORDER)

    (plugins / "my_loss.py").write_text(LOSS.format(suffix=", scaled", scale="0.5"))  # the loss function's source changed
    out = run_workflow("recipes/smoke.yaml", root, home, *args)
    second = dict(zip(ORDER[:-1], cache_lines(out.stdout + out.stderr)))
    assert [second[t] for t in ("base_model", "admit_model", "make_data", "sft", "convert", "rollout", "score")] == ["hit"] * 7  # the rollouts are kept
    assert second["train"] == "miss" and second["publish"] == "miss"  # the training step ran the new loss
    assert len(list(root.glob("checkpoint/0001-*"))) == 2  # the new program's checkpoint beside the old one's
