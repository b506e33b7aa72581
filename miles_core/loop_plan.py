"""The RL loop's plan: which iterations run sync and which as async phases, where evaluation falls, how the loop is cut
into blocks (one dynamic Flyte node each, so that a long run never builds one giant futures file), and which of its
checkpoints a run keeps (cluster.keep_checkpoints)."""

from __future__ import annotations

from miles_core.config import AsyncConfig


def phase_plan(iterations: int, cfg: AsyncConfig, eval_interval: int) -> list[tuple[int, int, bool]]:
    """[(first iteration, async steps, evaluate after it)] covering every iteration; async steps 0
    is one sync iteration. Evaluation follows the stretch that reaches a multiple of eval_interval,
    and the last one."""
    sync = {"sync": iterations, "async": 0, "mixed": cfg.sync_iterations}[cfg.schedule]
    plan = [(it, 0) for it in range(sync)]
    plan += [(it, min(cfg.steps_per_phase, iterations - it)) for it in range(sync, iterations, cfg.steps_per_phase)]
    return [(it, k, (it + max(k, 1)) // eval_interval > it // eval_interval or it + max(k, 1) == iterations) for it, k in plan]


def plan_blocks(plan: list[tuple[int, int, bool]], size: int) -> list[tuple[int, int]]:
    """[(first iteration, stop)] of consecutive blocks covering `plan`, each of at most `size` iterations; a block never
    splits an async phase, and a phase longer than `size` is a block of its own."""
    blocks: list[tuple[int, int]] = []
    for it, steps, _ in plan:
        stop = it + max(steps, 1)
        if blocks and stop - blocks[-1][0] <= size:
            blocks[-1] = (blocks[-1][0], stop)
        else:
            blocks.append((it, stop))
    return blocks


def block_plan(plan: list[tuple[int, int, bool]], first: int, stop: int) -> list[tuple[int, int, bool]]:
    """The entries of `plan` that one block, iterations [first, stop), runs."""
    return [entry for entry in plan if first <= entry[0] < stop]


def checkpoints_written(plan: list[tuple[int, int, bool]]) -> list[int]:
    """The iterations done when each checkpoint of the loop is written, in order: 0 (the converted start), then one after
    each sync iteration and each async phase."""
    return [0, *(it + max(steps, 1) for it, steps, _ in plan)]


def retired(written: list[int], done: int, keep: int, every: int) -> int | None:
    """The checkpoint (the iterations done when it was written) that the one written after `done` iterations leaves
    behind: the one `keep` checkpoints before it, unless it is kept for good, written after a multiple of `every`
    iterations. None where there is none: fewer checkpoints before it, or `keep` 0 (every checkpoint is kept)."""
    at = written.index(done) - keep
    if not keep or at < 0 or (every and written[at] % every == 0):
        return None
    return written[at]
