"""What every config section shares: the error type and the value check."""

from __future__ import annotations


class ConfigError(ValueError):
    """A recipe or config value is wrong; the message names the file and key path."""


def check(ok: bool, key: str, reason: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {reason}")
