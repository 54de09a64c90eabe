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

import abc
import threading

from ..comm.base import Communicator
from ._allreduce import AllreduceStore, Entry
from ._interface import Key

__all__ = ["Sequencer", "SequencedStore"]


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


class SequencedStore(AllreduceStore):
    """A KVStore whose operations leave in :class:`Sequencer` order: each type says only what to do
    with a released entry (``_dispatch``, called under the store's lock, in release order)."""

    def __init__(self, comm: Communicator, warn_after: float = 60.0, abort_after: float | None = 600.0) -> None:
        super().__init__(comm, warn_after, abort_after)
        self._seq = Sequencer()
        self._lock = threading.RLock()

    def _registered(self, key: Key) -> None:
        self._seq.add_key(key)

    def _enqueue(self, entry: Entry) -> None:
        with self._lock:
            self._tracker.start(entry.key)
            self._arriving(entry)
            for e in self._seq.arrive(entry):
                self._dispatch(e)

    def _flush(self) -> None:
        with self._lock:
            for e in self._seq.flush():
                self._dispatch(e)

    def _arriving(self, entry: Entry) -> None:  # noqa: B027 - optional hook
        """Hook: adjust `entry` as it is pushed, before ordering."""

    @abc.abstractmethod
    def _dispatch(self, e: Entry) -> None:
        """Start (or run) the collective of a released entry."""
