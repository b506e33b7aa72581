"""What a dynamic node's pod writes: its futures file (DynamicJobSpec), built by flytekit from the node's inputs as a
pod on a cluster builds it (task-execution mode, inputs as literals), without running anything it names."""

from __future__ import annotations

from flytekit import dynamic
from flytekit.core.context_manager import ExecutionState, FlyteContextManager
from flytekit.core.type_engine import TypeEngine
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from miles_core.config import RunConfig
from miles_core.data.source import DataState
from miles_core.loop_plan import checkpoints_written, phase_plan
from tasks.common import Checkpoint, Dataset, Policy, Tracking
from tests.flyte.test_compile import SETTINGS
from workflows.rl import rl_block

# inputs that point into an object store: building the futures file reads none of them
POLICY = Policy(dir=FlyteDirectory("s3://runs/policy/v1"), version=1)
TEACHER = Policy(dir=FlyteDirectory("s3://runs/teacher/0"), version=0)
CHECKPOINT = Checkpoint(dir=FlyteDirectory("s3://runs/checkpoint/0"), step=0)
DATASET = Dataset(train=FlyteFile("s3://runs/data/train.jsonl"), test=FlyteFile("s3://runs/data/test.jsonl"), sha256="0" * 64)
RUN = Tracking(uri="http://mlflow:5000", run_id="0" * 32)


def futures(task, **inputs):
    """The DynamicJobSpec the pod of dynamic `task` writes for `inputs` (Python values). flytekit builds a dynamic's
    workflow once per process (a pod runs one): each call here defines the dynamic again, as a fresh pod would."""
    task = dynamic(task.task_function)
    ctx = FlyteContextManager.current_context().with_serialization_settings(SETTINGS)
    with FlyteContextManager.with_context(ctx) as ctx:
        state = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
        with FlyteContextManager.with_context(ctx.with_execution_state(state)) as ctx:
            literals = TypeEngine.dict_to_literal_map(ctx, inputs, task.python_interface.inputs)
            return task.dispatch_execute(ctx, literals)


def nodes_by_task(spec) -> dict[str, list]:
    """{task name: [nodes]} of a futures file (task nodes only)."""
    out: dict[str, list] = {}
    for node in spec.nodes:
        out.setdefault(node.task_node.reference_id.name, []).append(node)
    return out


def inputs(node) -> dict:
    """{input name: its binding} of a node."""
    return {b.var: b.binding for b in node.inputs}


def template_of(spec, node):
    return next(t for t in spec.tasks if t.id == node.task_node.reference_id)


def stored_checkpoint(done: int) -> Checkpoint:
    """A checkpoint in the object store written after `done` iterations (CHECKPOINT: the converted start)."""
    return Checkpoint(dir=FlyteDirectory(f"s3://runs/checkpoint/{done}"), step=done) if done else CHECKPOINT


def stored_policy(done: int) -> Policy:
    """The policy published after `done` iterations (POLICY: the SFT policy, the converted start's)."""
    return Policy(dir=FlyteDirectory(f"s3://runs/policy/{done}"), version=done + 1) if done else POLICY


def block_futures(cfg: RunConfig, first: int, stop: int, handed: int | None = None):
    """The futures file of the loop's block of iterations [first, stop), started from the inputs above; the newest
    checkpoints the block is handed (`handed` of them, else cluster.keep_checkpoints) are `stored_checkpoint`s."""
    written = checkpoints_written(phase_plan(cfg.iterations, cfg.async_phase, cfg.evaluation.interval))
    handed = cfg.cluster.keep_checkpoints if handed is None else handed
    done = written[: written.index(first) + 1][-handed:] if handed else []
    recent, policies = [stored_checkpoint(n) for n in done], [stored_policy(n) for n in done]
    state = {"ckpt": recent[-1] if recent else CHECKPOINT, "policy": policies[-1] if policies else POLICY, "state": DataState(), "buffer": None}
    state |= {"recent": recent, "recent_policies": policies, "evaluation": {}}
    teacher = TEACHER if cfg.distill.teacher else None
    return futures(rl_block, cfg=cfg, reference=POLICY, teacher=teacher, dataset=DATASET, run=RUN, **state, first=first, stop=stop)
