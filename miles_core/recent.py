"""What a process keeps of contents it read or checked: a mapping bounded to its most recently used entries.

Keyed by what decides the value (a digest of a batch's bytes and its checks, a tokenizer's files, a config's bytes), so
the same contents at another path are found, and any other contents are not.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import TypeVar

V = TypeVar("V")


class Recent(collections.OrderedDict):
    """A mapping that keeps its `size` most recently used entries, the oldest dropped first."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def kept(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value under `key`, made by `make()` where there is none; the least recently used beyond `size` dropped."""
        if key not in self:
            self[key] = make()
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)
        return self[key]
