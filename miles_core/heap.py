"""Long-running work beside a large, long-lived heap: the objects alive when it starts kept out of the cyclic
garbage collector's way.

A task's or actor's process holds the modules of torch, transformers, flytekit, pandas and mlflow before its own code
runs: 0.6-0.9 million objects that live as long as the process. CPython's full collection walks every tracked object,
and allocation-heavy code (a batch of samples read, checked and written) triggers one every few hundred thousand new
objects: 0.1-0.4 s each, several per RL iteration of the main recipe's local run. `frozen_heap` moves what is alive
when it starts into the permanent generation (`gc.freeze`), which collections skip, and back into the oldest
generation when it ends (`gc.unfreeze`): collections within it walk only what it allocates, and what it leaves
behind is collected as before. Nested, only the outermost freezes and unfreezes; where something else froze objects
already, it leaves them as they are.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def frozen_heap():
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
