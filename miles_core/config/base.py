"""What every config section shares: the error type and the value checks."""

from __future__ import annotations

import dataclasses
import math


class ConfigError(ValueError):
    """A recipe or config value is wrong; the message names the file and key path."""


def check(ok: bool, key: str, reason: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {reason}")


def check_finite(section, path: str) -> None:
    """Every float key of `section` (and of its nested sections) is a finite number: NaN passes no
    range check by accident and infinity none by design. `path` is the section's key path."""
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{path}.{f.name}" if path else f.name
        if dataclasses.is_dataclass(value):
            check_finite(value, key)
        elif isinstance(value, float):
            check(math.isfinite(value), key, f"must be a finite number, got {value}")
