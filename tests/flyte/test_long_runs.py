"""A long run is a loop of blocks: the loop's futures file holds the conversion and one node per block, each block's
holds at most cluster.block_iterations iterations, and the state passes from block to block. Read from the futures
files the dynamic nodes write (tests/flyte/futures.py); the sync iterations, async phases and evaluations they name
are exactly the loop's plan."""

import dataclasses

import pytest

from miles_core.config import AsyncConfig, ClusterConfig, EvalConfig, RunConfig
from miles_core.loop_plan import phase_plan
from tests.flyte.futures import DATASET, POLICY, RUN, block_futures, futures, inputs, nodes_by_task
from workflows.rl import LoopState, rl_loop

pytestmark = pytest.mark.flyte

MIXED = AsyncConfig(schedule="mixed", sync_iterations=3, steps_per_phase=4, max_staleness=0)


def config(iterations: int, block: int = 20, interval: int = 5, schedule: AsyncConfig = AsyncConfig()) -> RunConfig:
    return dataclasses.replace(
        RunConfig(), iterations=iterations, cluster=ClusterConfig(block_iterations=block), evaluation=EvalConfig(interval=interval), async_phase=schedule
    )


def block_range(node) -> tuple[int, int]:
    return inputs(node)["first"].scalar.primitive.integer, inputs(node)["stop"].scalar.primitive.integer


def test_a_thousand_iterations_compile_to_bounded_futures_files():
    cfg = config(1000)
    loop = nodes_by_task(futures(rl_loop, cfg=cfg, start=POLICY, dataset=DATASET, run=RUN))
    assert set(loop) == {"tasks.rl.convert", "workflows.rl.rl_block"}
    blocks = loop["workflows.rl.rl_block"]
    assert len(blocks) == 50 and [block_range(b) for b in blocks] == [(i, i + 20) for i in range(0, 1000, 20)]
    block = nodes_by_task(block_futures(cfg, 20, 40))
    per_task = {name: len(nodes) for name, nodes in block.items()}
    assert per_task == {
        "tasks.rl.rollout": 20,
        "tasks.rl.score": 20,
        "tasks.rl.train": 20,
        "tasks.rl.publish": 20,
        "tasks.tracking.log_iteration": 20,
        "tasks.rl.evaluate": 4,  # after iterations 25, 30, 35, 40
    }


def test_each_block_starts_from_the_state_the_one_before_left():
    spec = futures(rl_loop, cfg=config(45), start=POLICY, dataset=DATASET, run=RUN)
    convert = nodes_by_task(spec)["tasks.rl.convert"][0]
    blocks = nodes_by_task(spec)["workflows.rl.rl_block"]
    assert inputs(blocks[0])["ckpt"].promise.node_id == convert.id
    for before, block in zip(blocks, blocks[1:]):
        for name in LoopState._fields:
            assert (inputs(block)[name].promise.node_id, inputs(block)[name].promise.var) == (before.id, name)
    assert {o.var: o.binding.promise.node_id for o in spec.outputs} == {"policy": blocks[-1].id, "evaluation": blocks[-1].id}


def after(by_id: dict, node) -> int:
    """The iteration after which an evaluate node runs: that of the publish or async phase whose policy it reads."""
    source = by_id[inputs(node)["policy"].promise.node_id]
    if source.task_node.reference_id.name == "tasks.async_phase.async_phase":
        return sum(inputs(source)[k].scalar.primitive.integer for k in ("first_iteration", "steps"))
    train = by_id[inputs(source)["ckpt"].promise.node_id]
    return inputs(train)["iteration"].scalar.primitive.integer + 1


def planned(cfg: RunConfig) -> tuple[list, list, list]:
    """(sync iterations, async phases as (first, steps), iterations after which evaluation runs) over every block."""
    loop = futures(rl_loop, cfg=cfg, start=POLICY, dataset=DATASET, run=RUN)
    sync, phases, evaluated = [], [], []
    for block in nodes_by_task(loop)["workflows.rl.rl_block"]:
        spec = block_futures(cfg, *block_range(block))
        by_id = {n.id: n for n in spec.nodes}
        named = nodes_by_task(spec)
        sync += [inputs(n)["iteration"].scalar.primitive.integer for n in named.get("tasks.rl.rollout", [])]
        phases += [tuple(inputs(n)[k].scalar.primitive.integer for k in ("first_iteration", "steps")) for n in named.get("tasks.async_phase.async_phase", [])]
        evaluated += [after(by_id, n) for n in named.get("tasks.rl.evaluate", [])]
    return sync, phases, evaluated


def test_blocks_keep_the_plans_sync_iterations_async_phases_and_evaluations():
    cfg = config(14, block=7, interval=3, schedule=MIXED)
    plan = phase_plan(14, MIXED, 3)
    sync, phases, evaluated = planned(cfg)  # in two blocks: iterations 0-2 and the phase 3-6, then the phases 7-10 and 11-13
    assert sync == [it for it, steps, _ in plan if not steps] == [0, 1, 2]
    assert phases == [(it, steps) for it, steps, _ in plan if steps] == [(3, 4), (7, 4), (11, 3)]
    assert evaluated == [it + max(steps, 1) for it, steps, due in plan if due] == [3, 7, 11, 14]


def test_the_last_evaluation_crosses_a_block_without_one():
    """A block whose iterations reach no evaluation passes on the last one it was given."""
    spec = block_futures(config(40, block=4, interval=10), 4, 8)
    assert "tasks.rl.evaluate" not in nodes_by_task(spec)
    evaluation = next(o.binding for o in spec.outputs if o.var == "evaluation")
    assert evaluation.promise is None and evaluation.map is not None  # the block's own input, {} here, unchanged
