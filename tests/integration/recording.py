"""A custom `rollout.rollout_fn` for tests: records how it was called, then runs the default.

Each call appends one JSON line to the file named by $MILES_RECORD_FILE (set by the test; Ray
actors get it through their runtime environment): the plug-points it was handed, each with the
settings bound to it, and the rollout settings that mean the same per sync step and per async
lease (prompts_per_step is the batch size, which is a lease's size in async mode).
"""

from __future__ import annotations

import dataclasses
import json
import os

from miles_core import step


def describe(fn) -> dict:
    """A plug-point's function and the config sections bound to it (functools.partial keywords)."""
    inner = getattr(fn, "func", fn)
    bound = {k: dataclasses.asdict(v) for k, v in getattr(fn, "keywords", {}).items()}
    return {"fn": f"{inner.__module__}:{inner.__qualname__}", "bound": bound}


def rollout(engine, source, tokenizer, fns, scorer, buffer, seed):
    settings = {k: v for k, v in dataclasses.asdict(fns.rollout).items() if k != "prompts_per_step"}
    fields = ("generate_fn", "reward_fn", "group_fn", "post_fn", "dynamic_filter_fn", "buffer_filter_fn")
    call = {"settings": settings, "reward": dataclasses.asdict(fns.reward), **{f: describe(getattr(fns, f)) for f in fields}}
    samples, left, metrics = step.rollout(engine, source, tokenizer, fns, scorer, buffer, seed)
    call["generated"] = metrics["rollout/generated_samples"]
    with open(os.environ["MILES_RECORD_FILE"], "a", encoding="utf-8") as f:
        f.write(json.dumps(call, sort_keys=True) + "\n")
    return samples, left, metrics
