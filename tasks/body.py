"""What every task's function runs inside, as its task runs it."""

from __future__ import annotations

import functools

from miles_core.heap import frozen_heap
from tasks.retry import recoverable


def task_body(fn):
    """`fn` with transient errors raised as recoverable, for Flyte to retry (tasks/retry.py), and the objects its process
    held before it out of the garbage collector's way while it runs (miles_core/heap.py). A dynamic node's body too:
    in a local run it runs the nodes it builds, each task's body nested in its own."""
    run = recoverable(fn)

    @functools.wraps(fn)
    def body(*args, **kwargs):
        with frozen_heap():
            return run(*args, **kwargs)

    return body
