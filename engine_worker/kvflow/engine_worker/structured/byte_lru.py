"""A least-recently-used map bounded by the bytes of its entries (each entry's size is given
when it is put), thread-safe: the compiled-grammar cache of grammar.py."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteLru(Generic[K, V]):
    def __init__(self, max_bytes: int) -> None:
        assert max_bytes >= 1
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: K, value: V, num_bytes: int) -> None:
        """Keep ``value`` as the most recent, evicting the least recent entries until all fit.
        An entry larger than the whole cache is not kept (it would evict everything)."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_bytes -= old[1]
            if num_bytes > self.max_bytes:
                return
            self._entries[key] = (value, num_bytes)
            self.num_bytes += num_bytes
            while self.num_bytes > self.max_bytes:
                _, (_, evicted_bytes) = self._entries.popitem(last=False)
                self.num_bytes -= evicted_bytes

    def __contains__(self, key: K) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
