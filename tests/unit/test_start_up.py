"""What a task's module imports is paid at the start of each of its pods: a pod builds the task again from its module.
The task and workflow modules import no model code, so a pod that trains and generates nothing (the tracking tasks,
score, a torch checkpoint's publish, a dynamic node compiling the next iterations) starts without transformers' model
classes (seconds on this CPU) or an optional backend; a task that needs them loads them where it uses them."""

import subprocess
import sys

from tests.conftest import REPO

MODULES = ("workflows.rl", "workflows.replay", "workflows.debug", "workflows.convert", "workflows.launch_plans", "tasks.tracking")
MODEL_CODE = ("transformers.modeling_utils", "miles_core.models.loading", "miles_core.train.torch_backend", "megatron.core", "peft", "sglang")


def test_the_task_and_workflow_modules_load_no_model_code():
    code = f"import sys, {', '.join(MODULES)}; print(' '.join(m for m in {MODEL_CODE!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == []
