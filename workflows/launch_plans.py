"""One launch plan per recipe (recipes/*.yaml and the tiny twins in recipes/tiny/): the RL workflow with the recipe's
RunConfig as its fixed input, named `rl.<recipe>` (`rl.tiny.<recipe>` for a twin), notifying the recipe's
cluster.failure_emails when a run fails, times out or is aborted. A recipe whose plug-in modules no image holds is
refused here (containers/images.py `check_plugins_in_image`).

    pyflyte register --image <image> workflows/launch_plans.py      # then launch `rl.<recipe>` from the console or CLI

The `*_base.yaml` files are what recipes extend, not experiments: they get none. A recipe's local run root stays as it
is written (relative: the pod's working directory); set run_root to an object-store URI for a cluster.
"""

from __future__ import annotations

from pathlib import Path

from flytekit import Email, LaunchPlan
from flytekit.models.core.execution import WorkflowExecutionPhase

from containers.images import check_plugins_in_image
from miles_core.config import load_recipe
from workflows.rl import rl

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
FAILED = [WorkflowExecutionPhase.FAILED, WorkflowExecutionPhase.TIMED_OUT, WorkflowExecutionPhase.ABORTED]


def recipe_files() -> list[Path]:
    """Every recipe a launch plan is made of: recipes/*.yaml and recipes/tiny/*.yaml, bases excepted."""
    return sorted(p for p in [*RECIPES.glob("*.yaml"), *RECIPES.glob("tiny/*.yaml")] if not p.stem.endswith("_base"))


def plan_name(path: Path) -> str:
    return ".".join(("rl", *path.relative_to(RECIPES).with_suffix("").parts))


def launch_plan(path: Path, name: str) -> LaunchPlan:
    """The RL workflow with the recipe at `path` as its fixed input, failure notifications from its cluster section."""
    cfg = load_recipe(path, resolve_root=False)
    check_plugins_in_image(cfg)
    emails = cfg.cluster.emails()
    notifications = [Email(phases=FAILED, recipients_email=emails)] if emails else []
    return LaunchPlan.get_or_create(workflow=rl, name=name, fixed_inputs={"cfg": cfg}, notifications=notifications)


LAUNCH_PLANS = {plan_name(path): launch_plan(path, plan_name(path)) for path in recipe_files()}
