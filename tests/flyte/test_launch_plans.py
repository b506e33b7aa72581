"""One launch plan per recipe, registered the way a cluster gets them (`pyflyte register`, dry run: no backend here),
each with the recipe's RunConfig fixed and the recipe's failure notifications."""

import subprocess
from collections import OrderedDict

import pytest
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.type_engine import TypeEngine
from flytekit.models.core.execution import WorkflowExecutionPhase
from flytekit.tools.translator import get_serializable

from miles_core.config import RunConfig, load_recipe
from tests.conftest import PYFLYTE, REPO, workflow_env
from tests.flyte.test_compile import SETTINGS
from workflows.launch_plans import LAUNCH_PLANS, launch_plan

pytestmark = pytest.mark.flyte

RECIPES = sorted(p for p in [*(REPO / "recipes").glob("*.yaml"), *(REPO / "recipes" / "tiny").glob("*.yaml")] if not p.stem.endswith("_base"))


def test_pyflyte_registers_one_launch_plan_per_recipe(tmp_path):
    out = subprocess.run(
        [str(PYFLYTE), "register", "--copy", "none", "--dry-run", "--image", "ghcr.io/miles-flyte/cpu:v0", "--version", "v0", "workflows/launch_plans.py"],
        cwd=REPO,
        env=workflow_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    registered = sorted(line.split("Launch Plan: ")[1].split()[0] for line in out.stdout.splitlines() if "Launch Plan: " in line)
    expected = sorted(".".join(("rl", *p.relative_to(REPO / "recipes").with_suffix("").parts)) for p in RECIPES)
    defaults = ["workflows.rl.rl", "workflows.rl.rl_recipe"]  # each workflow's default launch plan
    assert [name for name in registered if name not in defaults] == expected and set(defaults) <= set(registered)
    assert "rl.smoke" in expected and "rl.tiny.qwen3_5_27b" in expected
    assert "Workflow: workflows.rl.rl" in out.stdout and "Workflow: workflows.rl.rl_recipe" in out.stdout


def fixed_config(plan) -> RunConfig:
    spec = get_serializable(OrderedDict(), SETTINGS, plan).spec
    literal = spec.fixed_inputs.literals["cfg"]
    return TypeEngine.to_python_value(FlyteContextManager.current_context(), literal, RunConfig)


@pytest.mark.parametrize("name, recipe", [("rl.gpt_oss_20b", "gpt_oss_20b.yaml"), ("rl.tiny.glm5", "tiny/glm5.yaml")])
def test_a_launch_plan_fixes_its_recipe(name, recipe):
    assert fixed_config(LAUNCH_PLANS[name]) == load_recipe(REPO / "recipes" / recipe, resolve_root=False)


def test_failure_emails_become_notifications(tmp_path):
    path = tmp_path / "notify.yaml"
    path.write_text("name: notify\ncluster: {failure_emails: 'ml-oncall@example.com, lead@example.com'}\n")
    spec = get_serializable(OrderedDict(), SETTINGS, launch_plan(path, "rl.test.notify")).spec
    (notification,) = spec.entity_metadata.notifications
    assert notification.email.recipients_email == ["ml-oncall@example.com", "lead@example.com"]
    assert set(notification.phases) == {WorkflowExecutionPhase.FAILED, WorkflowExecutionPhase.TIMED_OUT, WorkflowExecutionPhase.ABORTED}
    assert not get_serializable(OrderedDict(), SETTINGS, LAUNCH_PLANS["rl.smoke"]).spec.entity_metadata.notifications  # no addresses, none
