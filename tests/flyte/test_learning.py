"""Learning is a tested property: the main job's short twin (recipes/tiny_arith_learn.yaml) must
learn, on each backend, through a real `pyflyte run`.

SFT must lift held-out greedy accuracy from the random base model (about 0) above SFT_FLOOR, and RL
must then raise it by at least RL_MARGIN. The three runs share one run root and Flyte cache, so the
base model, the data and SFT run once (the torch run) and the megatron and SGLang runs start from
the same cached SFT policy: their difference is the RL phase alone. A change that stops any
backend from learning turns this red.
"""

import re

import pytest

from tests.conftest import run_workflow

pytestmark = pytest.mark.flyte

RECIPE = "recipes/tiny_arith_learn.yaml"
SFT_FLOOR = 0.35  # the teacher's greedy answer is right on the problems without a carry (about half)
RL_MARGIN = 0.10  # RL against the verifier fixes carries the teacher drops
REPORT = re.compile(r"held-out greedy accuracy: before RL ([0-9.]+) -> after RL ([0-9.]+)")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    base = tmp_path_factory.mktemp("learning")
    return base / "runs", base / "home"


def accuracies(out) -> tuple[float, float]:
    ((before, after),) = REPORT.findall(out.stdout)
    return float(before), float(after)


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param([], id="torch"),
        pytest.param(["train.backend=megatron"], id="megatron", marks=pytest.mark.integration),
        pytest.param(["rollout.engine=sglang"], id="sglang", marks=pytest.mark.integration),
    ],
)
def test_sft_then_rl_raise_held_out_accuracy(shared, backend):
    root, home = shared
    out = run_workflow(RECIPE, root, home, *backend)
    before, after = accuracies(out)
    assert before >= SFT_FLOOR, f"SFT did not learn: held-out accuracy {before:.3f} < {SFT_FLOOR}"
    assert after >= before + RL_MARGIN, f"RL did not learn: {before:.3f} -> {after:.3f} (needs +{RL_MARGIN})"
    assert "RL raised held-out accuracy" in out.stdout and "RL did not learn" not in out.stdout
