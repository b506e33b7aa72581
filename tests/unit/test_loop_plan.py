"""The loop's plan: sync iterations and async phases, evaluation on the interval, and blocks of bounded size."""

import pytest

from miles_core.config import AsyncConfig
from miles_core.loop_plan import block_plan, phase_plan, plan_blocks


def test_phase_plan_covers_every_iteration_and_evaluates_on_the_interval():
    assert phase_plan(3, AsyncConfig(), 2) == [(0, 0, False), (1, 0, True), (2, 0, True)]
    assert phase_plan(7, AsyncConfig(schedule="async", steps_per_phase=3), 5) == [(0, 3, False), (3, 3, True), (6, 1, True)]
    mixed = AsyncConfig(schedule="mixed", sync_iterations=2, steps_per_phase=2)
    assert phase_plan(5, mixed, 1) == [(0, 0, True), (1, 0, True), (2, 2, True), (4, 1, True)]
    assert phase_plan(5, mixed, 10) == [(0, 0, False), (1, 0, False), (2, 2, False), (4, 1, True)]


def test_sync_iterations_fill_blocks_of_the_given_size():
    assert plan_blocks(phase_plan(45, AsyncConfig(), 5), 20) == [(0, 20), (20, 40), (40, 45)]
    assert plan_blocks(phase_plan(3, AsyncConfig(), 5), 20) == [(0, 3)]


def test_a_block_never_splits_an_async_phase():
    mixed = AsyncConfig(schedule="mixed", sync_iterations=3, steps_per_phase=4)
    assert plan_blocks(phase_plan(15, mixed, 5), 6) == [(0, 3), (3, 7), (7, 11), (11, 15)]
    assert plan_blocks(phase_plan(10, AsyncConfig(schedule="async", steps_per_phase=8), 5), 3) == [(0, 8), (8, 10)]  # a phase above the size


@pytest.mark.parametrize("schedule", [AsyncConfig(), AsyncConfig(schedule="async", steps_per_phase=3), AsyncConfig(schedule="mixed", sync_iterations=7)])
def test_the_blocks_split_the_plan_without_loss_or_overlap(schedule):
    plan = phase_plan(100, schedule, 5)
    blocks = plan_blocks(plan, 20)
    assert [entry for first, stop in blocks for entry in block_plan(plan, first, stop)] == plan
    assert all(stop - first <= 20 for first, stop in blocks) and blocks[-1][1] == 100
