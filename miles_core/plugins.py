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
