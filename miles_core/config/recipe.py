"""Recipes: YAML files of overrides read into a RunConfig, checked key by key; hashing and flattening.

`python -m miles_core.config RECIPE [key=value ...]` (`seed=N`: every section's seed) prints the resolved config as JSON (what
`pyflyte run ... --cfg` takes) or the error and exits 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import sys
import typing
from pathlib import Path

import yaml

from miles_core.config.base import ConfigError
from miles_core.config.bounded_yaml import clip, load_text, read_yaml, short
from miles_core.config.run import RunConfig


def config_hash(obj) -> str:
    """A short stable hash of a config (section) for tags, paths and cache keys."""
    blob = json.dumps(dataclasses.asdict(obj), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def flatten(obj, prefix: str = "") -> dict[str, object]:
    """{"train.lr": 0.001, ...}: the flattened config, e.g. for MLflow params."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.update(flatten(value, key + "."))
        else:
            out[key] = value
    return out


def _suggest(key: str, known: set[str]) -> str:
    """The known keys closest to a misspelt one, or, when none is close, as many known keys as a short message holds."""
    close = difflib.get_close_matches(key, known, n=3)
    if close:
        return f"did you mean {' or '.join(close)}?"
    listed = ", ".join(sorted(known))
    return f"known: {listed if len(listed) <= 200 else listed[:200].rsplit(', ', 1)[0] + ', ...'}"


def _build(cls, values: dict, path: str):
    if not isinstance(values, dict):
        raise ConfigError(f"{path or 'recipe'}: expected a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        key_path = f"{path}.{clip(str(key))}" if path else clip(str(key))
        if key not in known:
            raise ConfigError(f"{key_path}: unknown key ({_suggest(clip(str(key)), known)})")
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            kwargs[key] = _build(kind, value, key_path)
        else:
            kwargs[key] = _coerce(kind, value, key_path)
    return cls(**kwargs)


def _coerce(kind, value, key_path: str):
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[kind]
    if not ok:
        raise ConfigError(f"{key_path}: expected {kind.__name__}, got {type(value).__name__} {short(value)}")
    if kind is float and not math.isfinite(value):  # YAML's .nan / .inf: no range check would read them as meant
        raise ConfigError(f"{key_path}: must be a finite number, got {value}")
    return kind(value)


def _read_values(path: Path, seen: tuple[Path, ...] = (), library: Path | None = None) -> dict:
    """A recipe's values; `extends: other.yaml` (relative to the recipe, else to `library`) is read first and
    overridden. An empty file (or one of comments only, or `{}`) is refused: it would silently run the defaults."""
    values = read_yaml(path)
    if values is None or values == {}:
        raise ConfigError(f"{path.name} is empty: write the keys it overrides (at least `name:`), or `extends: other.yaml`")
    if not isinstance(values, dict) or "extends" not in values:
        return values
    extends = values.pop("extends")
    if not isinstance(extends, str) or not extends or Path(extends).is_absolute():
        raise ConfigError(f"extends: expected a recipe path relative to {path.name}, got {short(extends)}")
    base = (path.parent / extends).resolve()
    if library is not None and not base.exists():
        base = (library / extends).resolve()
    if base in (*seen, path):
        raise ConfigError(f"extends: {base} is extended in a cycle")
    try:
        return _merge(_read_values(base, (*seen, path), library), values)
    except FileNotFoundError:
        raise ConfigError(f"extends: recipe file {base} not found") from None


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_recipe(path: str | Path, overrides: dict | None = None, resolve_root: bool = True, library: Path | None = None) -> RunConfig:
    """Read a YAML recipe (overrides of the defaults), checked key by key; errors name the file. A recipe it extends
    that is not beside it is looked up in `library` (a recipe file downloaded alone: the recipes the image holds). A
    local run root is made absolute (against the working directory) unless `resolve_root` is false; an object-store
    URI stays as written."""
    path = Path(path)
    try:
        cfg = _overridden(_read_values(path.resolve(), library=library), overrides or {})
    except FileNotFoundError:
        raise ConfigError(f"{path}: recipe file not found") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {clip(str(err))}") from None
    except (IsADirectoryError, PermissionError) as err:
        raise ConfigError(f"{path}: cannot read the recipe: {err.strerror}") from None
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    if not resolve_root or "://" in cfg.run_root:
        return cfg
    return dataclasses.replace(cfg, run_root=str(Path(cfg.run_root).resolve()))


def config_from_json(text: str) -> RunConfig:
    """A RunConfig from JSON text, checked like a recipe's values: unknown keys and wrong types are refused by key path."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"the config is not valid JSON: {err}") from None
    return _build(RunConfig, values, "")


def with_overrides(cfg: RunConfig, overrides: dict) -> RunConfig:
    """`cfg` with dotted `key: value` overrides (as `parse_overrides` reads them), checked like a recipe's."""
    return _overridden(dataclasses.asdict(cfg), overrides)


def _overridden(values: dict, overrides: dict) -> RunConfig:
    """The RunConfig of a recipe's values with dotted overrides set (`seed=N` first expanded to every seeded section)."""
    for key, value in _expand_seed(overrides).items():
        _set_dotted(values, key, value)
    return _build(RunConfig, values, "")


SEEDED_SECTIONS = ("model", "data", "sft", "rollout", "train")


def _expand_seed(overrides: dict) -> dict:
    """The override `seed=N` sets the seed of every seeded section (model, data, sft, rollout, train),
    before any section's own `<section>.seed`."""
    if "seed" not in overrides:
        return overrides
    rest = {k: v for k, v in overrides.items() if k != "seed"}
    return {f"{section}.seed": overrides["seed"] for section in SEEDED_SECTIONS} | rest


def _set_dotted(values: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    if not all(dotted.split(".")):
        raise ConfigError(f"override {short(dotted)}: empty key in the dotted path")
    for key in parents:
        values = values.setdefault(key, {})
        if not isinstance(values, dict):
            raise ConfigError(f"override {short(dotted)}: {key} is not a section")
    values[last] = value


def parse_overrides(args: list[str]) -> dict:
    """`key=value` arguments, each value read as one YAML scalar or flow value."""
    out = {}
    for arg in args:
        key, sep, text = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {short(arg)}: expected key=value")
        try:
            out[key] = load_text(text)
        except ConfigError as err:
            raise ConfigError(f"override {short(key)}: {err}") from None
        except yaml.YAMLError:
            raise ConfigError(f"override {short(key)}: value {short(text)} is not a YAML value") from None
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m miles_core.config RECIPE.yaml [key=value ...]", file=sys.stderr)
        return 2
    from miles_core.plugins import PluginError, check_plugins  # imports the plug-points' modules (torch)

    try:
        cfg = load_recipe(argv[0], parse_overrides(argv[1:]))
        check_plugins(cfg)
    except (ConfigError, PluginError) as err:
        print(f"bad recipe: {err}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(cfg)))
    return 0
