"""The release order shared by funnel, concurrent and depchain: init order, the same on every worker.

Between two flushes (a *round*, ended by ``wait``/``pull``/``barrier``) an operation is released at
once when it is the first of its key in the round and the first operation of every key initialized
before it has been released; anything else (a key that arrived early, a second operation on a key)
is held until the flush, which releases the rest sorted by (init index, occurrence). If every worker
issues the same multiset of operations per round, every worker releases them in the same order:
the eagerly released part is the longest init-order prefix of keys that all arrived, and the rest is
sorted. So workers may push their keys in different orders without deadlock, and overlap is best
when keys are initialized in the order they usually become ready (DataParallel: bucket 0 first).
"""

from __future__ import annotations

from .base import Entry, Key

__all__ = ["Sequencer"]


class Sequencer:
    """Turns per-worker arrival order into the common release order (single-threaded: caller's lock)."""

    def __init__(self) -> None:
        self._index: dict[Key, int] = {}
        self._order: list[Key] = []
        self._pos = 0
        self._first: dict[Key, Entry] = {}
        self._count: dict[Key, int] = {}
        self._repeats: list[Entry] = []

    def add_key(self, key: Key) -> None:
        """Append `key` to the release order (called in init order, the same on every worker)."""
        self._index[key] = len(self._order)
        self._order.append(key)

    def arrive(self, entry: Entry) -> list[Entry]:
        """Record `entry`; returns the entries now released, in release order."""
        n = self._count.get(entry.key, 0)
        self._count[entry.key] = n + 1
        entry.seq = n
        if n:
            self._repeats.append(entry)
            return []
        self._first[entry.key] = entry
        out = []
        while self._pos < len(self._order) and self._order[self._pos] in self._first:
            out.append(self._first.pop(self._order[self._pos]))
            self._pos += 1
        return out

    def flush(self) -> list[Entry]:
        """End the round: every held entry, sorted by (init index, occurrence)."""
        rest = sorted([*self._first.values(), *self._repeats], key=lambda e: (self._index[e.key], e.seq))
        self._pos, self._first, self._count, self._repeats = 0, {}, {}, []
        return rest

    @property
    def order(self) -> list[Key]:
        return list(self._order)
