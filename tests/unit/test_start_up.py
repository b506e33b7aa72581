"""What a task's module imports is paid at the start of each of its pods: a pod builds the task again from its module.
The task and workflow modules import no model code, so a pod that trains and generates nothing (the tracking tasks,
score, a torch checkpoint's publish, a dynamic node compiling the next iterations) starts without transformers' model
classes (seconds on this CPU) or an optional backend; a task that needs them loads them where it uses them. The modules
of the tasks that build no model at their start (tasks/tracking.py, each iteration's log among them; tasks/prepare.py;
tasks/replay.py) import neither torch nor transformers: their pods start without the seconds those take."""

import os
import subprocess
import sys

from tests.conftest import REPO

MODULES = ("workflows.rl", "workflows.replay", "workflows.debug", "workflows.convert", "workflows.launch_plans", "tasks.tracking")
LIGHT = ("tasks.tracking", "tasks.prepare", "tasks.replay", "tasks.retention")
MODEL_CODE = ("transformers.modeling_utils", "miles_core.models.loading", "miles_core.train.torch_backend", "megatron.core", "peft", "sglang")


def printed(code: str, env: dict[str, str] | None = None) -> list[str]:
    """The words `code` prints in a fresh interpreter, as a pod starts one."""
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.split()


def loaded(modules: tuple[str, ...], names: tuple[str, ...]) -> list[str]:
    """Which of `names` a fresh interpreter holds once it has imported `modules`."""
    return printed(f"import sys, {', '.join(modules)}; print(' '.join(m for m in {names!r} if m in sys.modules))")


def test_the_task_and_workflow_modules_load_no_model_code():
    assert loaded(MODULES, MODEL_CODE) == []


def test_the_modules_of_the_tasks_that_read_and_log_load_no_model_stack():
    assert loaded(LIGHT, ("torch", "transformers", "safetensors")) == []


def test_a_task_pod_never_reaches_a_hub_and_shows_no_bar_per_load():
    """huggingface_hub reads both settings once, at its import: tasks/__init__.py sets them before a task's module
    imports transformers (tasks/rl.py imports it before tasks/common.py, where they were set after it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    code = "import tasks.rl, huggingface_hub.constants as hub, transformers.utils.logging as log; print(hub.HF_HUB_OFFLINE, log.is_progress_bar_enabled())"
    assert printed(code, env) == ["True", "False"]
