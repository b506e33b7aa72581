"""The loop's plan: sync iterations and async phases, evaluation on the interval, blocks of bounded size, and the
checkpoints a run keeps."""

import pytest

from miles_core.config import AsyncConfig
from miles_core.loop_plan import block_plan, checkpoints_written, phase_plan, plan_blocks, retired


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


def test_a_checkpoint_is_written_at_the_start_after_each_sync_iteration_and_after_each_async_phase():
    assert checkpoints_written(phase_plan(3, AsyncConfig(), 5)) == [0, 1, 2, 3]
    mixed = AsyncConfig(schedule="mixed", sync_iterations=2, steps_per_phase=3)
    assert checkpoints_written(phase_plan(9, mixed, 5)) == [0, 1, 2, 5, 8, 9]


def survivors(written: list[int], keep: int, every: int) -> set[int]:
    """The checkpoints left once the whole loop has run: each new one prunes the one it leaves behind."""
    gone = {retired(written, done, keep, every) for done in written}
    return set(written) - gone


def test_a_run_keeps_its_newest_checkpoints_and_those_after_every_nth_iteration():
    written = checkpoints_written(phase_plan(12, AsyncConfig(), 5))
    assert survivors(written, 0, 0) == set(range(13))  # keep 0: every checkpoint
    assert survivors(written, 2, 0) == {11, 12}
    assert survivors(written, 2, 5) == {0, 5, 10, 11, 12}
    assert survivors(written, 1, 4) == {0, 4, 8, 12}
    assert [retired(written, done, 2, 5) for done in range(5)] == [None, None, None, 1, 2]  # the one two before, once it exists


def test_an_async_phase_leaves_behind_the_checkpoint_keep_checkpoints_before_its_own():
    mixed = AsyncConfig(schedule="mixed", sync_iterations=2, steps_per_phase=3)
    written = checkpoints_written(phase_plan(9, mixed, 5))  # [0, 1, 2, 5, 8, 9]
    assert [retired(written, done, 2, 0) for done in written] == [None, None, 0, 1, 2, 5]
    assert survivors(written, 2, 4) == {0, 8, 9}
