"""The one registry of plug-points: a dotted path "pkg.module:function" in the config.

A path is resolved once, at the start of the stage that uses it, and checked against the
plug-point's documented signature, so a typo fails with the config field's name instead of deep
inside a run.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path


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
    "rollout.rollout_fn": ("engine", "source", "tokenizer", "fns", "scorer", "buffer", "seed"),  # step.rollout
    "rollout.generate_fn": ("engine", "prompts", "tokenizer", "params"),  # step.generate
    "rollout.dynamic_filter_fn": ("group",),  # algos/filters.py
    "rollout.buffer_filter_fn": ("buffer", "n"),  # algos/filters.py
    "reward.fn": ("response", "label", "metadata"),  # rewards/base.py RewardFn
    "reward.group_fn": ("reward_fn", "responses"),  # rewards/base.py
    "reward.post_fn": ("samples", "group_size"),  # rewards/base.py
    "algo.advantage_fn": ("algo", "rewards", "mask", "group_size", "kl", "values"),  # algos/objective.py
    "algo.loss_fn": ("algo", "logprobs", "entropy", "mask", "extras"),  # algos/objective.py
    "algo.is_correction_fn": ("algo", "train_logprobs", "rollout_logprobs", "mask"),  # algos/objective.py
    "algo.sample_filter_fn": ("sample",),  # algos/filters.py
    "evaluation.fn": ("engine", "prompts", "tokenizer", "fns"),  # step.evaluate
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
    """Resolve every plug-point a RunConfig sets to other than its default: a bad path fails here, before anything runs.
    The defaults are the project's own functions, each resolved against its signature by the tests
    (tests/contracts/test_plugpoints.py); importing their modules (torch, transformers) to check them again cost the recipe
    command (`python -m miles_core.config`) 2.4 of its 5 s."""
    for field in PLUGPOINTS:
        section, name = field.split(".")
        section_cfg = getattr(run_cfg, section)
        if getattr(section_cfg, name) != getattr(type(section_cfg)(), name):
            plugin(section_cfg, section, name)


# The plug-points each stage runs: the code its cache version must follow besides its own modules.
STAGE_PLUGPOINTS: dict[str, tuple[str, ...]] = {
    "rollout": (
        "data.source_fn",
        "rollout.rollout_fn",
        "rollout.generate_fn",
        "rollout.dynamic_filter_fn",
        "rollout.buffer_filter_fn",
        "reward.fn",
        "reward.group_fn",
        "reward.post_fn",
    ),  # dynamic sampling scores during the rollout
    "score": ("reward.fn", "reward.group_fn", "reward.post_fn", "hooks.rollout_log"),
    "train": (
        "algo.advantage_fn",
        "algo.loss_fn",
        "algo.is_correction_fn",
        "algo.sample_filter_fn",
        "hooks.before_train_step",
        "hooks.after_train_step",
        "hooks.after_save",
    ),
    "evaluate": ("evaluation.fn", "rollout.generate_fn", "reward.fn", "reward.group_fn", "reward.post_fn"),
}
STAGE_PLUGPOINTS["async"] = tuple(dict.fromkeys(f for stage in ("rollout", "score", "train") for f in STAGE_PLUGPOINTS[stage]))


def source_file(module_name: str) -> Path | None:
    """The .py file of a module, found without importing it (only its top-level package is located)."""
    top, *rest = module_name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None  # a compiled or built-in module: its version is the environment's
    base = Path(spec.origin).parent if spec.origin.endswith("__init__.py") else Path(spec.origin).with_suffix("")
    for candidate in (base.joinpath(*rest).with_suffix(".py"), base.joinpath(*rest, "__init__.py")) if rest else (Path(spec.origin),):
        if candidate.is_file():
            return candidate
    return None


@functools.cache  # a process runs the code it loaded: each module's source is read once
def _source(module_name: str) -> str:
    path = source_file(module_name)
    return path.read_text(encoding="utf-8") if path else ""


def plugin_code(run_cfg, stage: str) -> str:
    """Digest of the source of the plug-in modules outside miles_core that `stage` runs (the recipe's
    own code: a changed loss function re-runs the train stage, and only it). miles_core's own modules
    are in each task's static cache version (`code_closure`)."""
    paths = sorted({getattr(getattr(run_cfg, f.split(".")[0]), f.split(".")[1]) for f in STAGE_PLUGPOINTS[stage]})
    modules = sorted({p.partition(":")[0] for p in paths if not p.startswith("miles_core.")})
    return hashlib.sha256(repr([(m, _source(m)) for m in modules]).encode()).hexdigest()[:12]


@functools.cache  # every closure walks the same modules: each source is parsed once
def _imported(module_name: str) -> frozenset[str]:
    """Every module name module_name's source imports anywhere (lazy imports included), `from pkg import name` as
    pkg.name too (it may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(_source(module_name))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return frozenset(found)


@functools.cache
def _imports(module_name: str, packages: tuple[str, ...]) -> frozenset[str]:
    """The modules of `packages` that module_name imports anywhere in its source."""
    return frozenset(m for m in _imported(module_name) if m.split(".")[0] in packages and source_file(m) is not None)


def code_closure(module_name: str, packages: tuple[str, ...] = ("miles_core", "tasks", "containers")) -> str:
    """Digest of the source of module_name and every module of `packages` it imports, transitively."""
    seen, todo = set(), [module_name]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += sorted(_imports(name, packages) - seen)
    return hashlib.sha256(repr([(m, _source(m)) for m in sorted(seen)]).encode()).hexdigest()[:12]
