"""A bounded YAML reader for recipes: a size cap, UTF-8 only, no anchors or aliases (an alias bomb
never expands), a nesting depth cap, string keys only, duplicate keys refused (plain YAML keeps the
last one silently). Every message is short: echoed values are truncated to `ECHO_CHARS`."""

from __future__ import annotations

from pathlib import Path

import yaml

from miles_core.config.base import ConfigError

MAX_RECIPE_BYTES = 1 << 20
MAX_DEPTH = 16
ECHO_CHARS = 80


def short(value) -> str:
    """repr(value), cut to ECHO_CHARS characters: an error message never grows with the input."""
    return clip(repr(value))


def clip(text: str) -> str:
    """`text` itself (no quotes), cut to ECHO_CHARS characters."""
    return text if len(text) <= ECHO_CHARS else text[: ECHO_CHARS - 3] + "..."


def _where(node) -> str:
    return f"line {node.start_mark.line + 1}"


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError(f"line {event.start_mark.line + 1}: YAML aliases (*{clip(event.anchor)}) are not allowed in recipes")
        event = self.peek_event()
        if getattr(event, "anchor", None) is not None:
            raise ConfigError(f"line {event.start_mark.line + 1}: YAML anchors (&{clip(event.anchor)}) are not allowed in recipes")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ConfigError(f"line {event.start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: set[str] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise ConfigError(f"{_where(key_node)}: key {short(key)} is not a string")
            if key in seen:
                raise ConfigError(f"{_where(key_node)}: duplicate key {short(key)}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_text(text: str):
    """YAML text through the bounded loader (a SafeLoader): ConfigError for what the bounds refuse."""
    return yaml.load(text, Loader=_BoundedLoader)


def read_yaml(path: Path):
    """The parsed YAML of `path` within the bounds above; ConfigError (naming the file) otherwise.
    FileNotFoundError passes through for the caller to name in its own terms."""
    size = path.stat().st_size
    if size > MAX_RECIPE_BYTES:
        raise ConfigError(f"{path.name}: {size} bytes, more than the {MAX_RECIPE_BYTES} a recipe may have")
    blob = path.read_bytes()[: MAX_RECIPE_BYTES + 1]
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path.name}: not UTF-8 (byte {err.start}: {short(blob[err.start : err.start + 4])})") from None
    if "\x00" in text:
        raise ConfigError(f"{path.name}: holds a NUL byte at character {text.index(chr(0))}")
    try:
        return load_text(text)
    except ConfigError as err:
        raise ConfigError(f"{path.name}: {err}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        raise ConfigError(f"{path.name}: not valid YAML at {where}: {clip(str(err.problem or err.context))}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path.name}: not valid YAML: {clip(str(err))}") from None
    except RecursionError:
        raise ConfigError(f"{path.name}: nested too deeply") from None
