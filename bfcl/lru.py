"""A least-recently-used cache bounded in bytes as well as in entries, for anything keyed by what a client sent.

`functools.lru_cache(maxsize=N)` bounds the number of entries, not their size: N entries keyed by 1 MiB strings
hold N MiB. `ByteLRU` takes each entry's size from the caller (`put(key, value, nbytes)`), evicts the least
recently used entries until both bounds hold, and refuses an entry larger than the whole budget.
Thread-safe (scoring workers and blocking perturbers run in threads).
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: what one entry costs besides its key and value: the OrderedDict slot, its links, the size record
ENTRY_OVERHEAD = 200


def text_bytes(value: str | bytes) -> int:
    """The memory a str or bytes key or value holds (its object, header included)."""
    return sys.getsizeof(value)


class ByteLRU(Generic[K, V]):
    """At most `max_entries` entries and `max_bytes` bytes (the sizes given to `put`, plus `ENTRY_OVERHEAD` each)."""

    def __init__(self, max_bytes: int, max_entries: int = 1 << 20) -> None:
        if max_bytes < 1 or max_entries < 1:
            raise ValueError("max_bytes and max_entries must be positive")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The bytes held now (never more than `max_bytes`)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def get(self, key: K, default: Any = None) -> V | Any:
        with self._lock:
            found = self._data.get(key)
            if found is None:
                return default
            self._data.move_to_end(key)
            return found[0]

    def put(self, key: K, value: V, nbytes: int) -> bool:
        """Keep `value` under `key`; False (and nothing kept) when it alone is over the budget."""
        size = max(0, nbytes) + ENTRY_OVERHEAD
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._data[key] = (value, size)
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._data) > self.max_entries:
                _, (_, dropped) = self._data.popitem(last=False)
                self._bytes -= dropped
        return True

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0
