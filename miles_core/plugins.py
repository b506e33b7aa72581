"""The one registry of plug-points: a dotted path "pkg.module:function" in the config.

A path is resolved once, at the start of the stage that uses it, and checked against the
plug-point's documented signature, so a typo fails with the config field's name instead of deep
inside a run.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable


class PluginError(ValueError):
    """A configured plug-point does not resolve or does not fit its signature."""


def load_function(path: str, field: str, params: tuple[str, ...] = ()) -> Callable:
    """Import "pkg.mod:fn" named by config field `field`; check it accepts `params` by position."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise PluginError(f"{field}: {path!r} is not a dotted path of the form 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise PluginError(f"{field}: cannot import module {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise PluginError(f"{field}: module {module_name!r} has no callable {attr!r}")
    try:
        inspect.signature(fn).bind(*params)
    except TypeError as err:
        raise PluginError(f"{field}: {path} does not take ({', '.join(params)}): {err}") from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return fn


# Every plug-point: config field -> the parameters its function takes, by position. The default
# implementation beside each documents what the parameters are and what it returns.
PLUGPOINTS: dict[str, tuple[str, ...]] = {
    "data.source_fn": ("prompts", "seed", "state"),  # data/source.py PromptSource
    "rollout.rollout_fn": ("engine", "source", "tokenizer", "cfg", "scorer", "buffer", "seed"),  # loop.rollout
    "rollout.generate_fn": ("engine", "prompts", "tokenizer", "params"),  # loop.generate
    "rollout.dynamic_filter_fn": ("group",),  # algos/filters.py
    "rollout.buffer_filter_fn": ("buffer", "n"),  # algos/filters.py
    "reward.fn": ("response", "label", "metadata"),  # rewards/base.py RewardFn
    "reward.group_fn": ("reward_fn", "responses", "label", "metadata"),  # rewards/base.py
    "reward.post_fn": ("samples", "group_size"),  # rewards/base.py
    "algo.advantage_fn": ("algo", "rewards", "mask", "group_size", "kl", "values"),  # algos/objective.py
    "algo.loss_fn": ("algo", "logprobs", "entropy", "mask", "extras"),  # algos/objective.py
    "algo.is_correction_fn": ("algo", "train_logprobs", "rollout_logprobs", "mask"),  # algos/objective.py
    "algo.sample_filter_fn": ("sample",),  # algos/filters.py
    "evaluation.fn": ("engine", "prompts", "tokenizer", "reward_fn", "reward", "cfg", "generate_fn"),  # loop.evaluate
    "hooks.before_train_step": ("trainer", "samples", "iteration"),  # hooks.py
    "hooks.after_train_step": ("trainer", "metrics", "iteration"),
    "hooks.after_save": ("ckpt_dir", "iteration"),
    "hooks.rollout_log": ("samples", "metrics", "iteration"),
}


def plugin(section_cfg, section: str, name: str) -> Callable:
    """The function configured at `<section>.<name>` (e.g. plugin(cfg.algo, "algo", "loss_fn"))."""
    field = f"{section}.{name}"
    return load_function(getattr(section_cfg, name), field, PLUGPOINTS[field])


def check_plugins(run_cfg) -> None:
    """Resolve every plug-point of a RunConfig: a bad path fails here, before anything runs."""
    for field in PLUGPOINTS:
        section, name = field.split(".")
        plugin(getattr(run_cfg, section), section, name)
