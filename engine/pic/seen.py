"""`SeenKeys`: a bounded record of keys seen, for "only on the second sighting" policies
(PicConfig.exact_prefix_passes and idle_alone_passes="repeated"). `saw(key)` says
whether `key` was seen before and records it; past `max_keys` the least recently seen
are forgotten (a forgotten key counts as new again). Not thread-safe: each owner uses
it from the engine loop's thread.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


class SeenKeys:
    """Keys seen, least recently seen first, at most `max_keys` (module docstring)."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def saw(self, key: Hashable) -> bool:
        """True when `key` was seen before (it becomes the most recent); else records it."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return True
        self._keys[key] = None
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        return False

    def clear(self) -> None:
        self._keys.clear()
