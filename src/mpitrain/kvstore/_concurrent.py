"""The `concurrent` KVStore (DAG paper §4.2): keys hashed onto C communicators, run by engine threads."""

from __future__ import annotations

import functools
import threading

from ..comm import after
from ..comm.base import Communicator
from ..engine import Engine, Var
from ._allreduce import Entry
from ._interface import KVStoreError, log, split_private
from ._sequencer import SequencedStore

__all__ = ["ConcurrentStore"]


class ConcurrentStore(SequencedStore):
    """Ordering: key ``k`` uses communicator ``init_index(k) % num_comms``; the :class:`Sequencer` hands
    operations to the engine's comm pool in init-key order, and each communicator's tasks mutate its
    own engine variable, so they run in that order on every worker while up to `num_comms` collectives
    progress at once. At most `outstanding` (default `num_comms`) are in flight: issuing one more
    blocks the caller until one completes (the paper's ``mpi_outstanding``)."""

    type = "concurrent"

    def __init__(self, comm: Communicator, num_comms: int = 2, outstanding: int | None = None,
                 warn_after: float = 60.0, abort_after: float | None = 600.0) -> None:
        if num_comms < 1 or (outstanding is not None and outstanding < 1):
            raise KVStoreError(f"concurrent needs num_comms >= 1 and outstanding >= 1, got {num_comms}, "
                               f"{outstanding}")
        super().__init__(comm, warn_after, abort_after)
        self._comms = [split_private(comm) for _ in range(num_comms)]
        self._vars = [Var(f"concurrent-comm{c}") for c in range(num_comms)]
        self._engine = Engine({"comm": num_comms}, warn_after=warn_after)
        self._outstanding = outstanding or num_comms
        self._slots = threading.Semaphore(self._outstanding)

    def _dispatch(self, e: Entry) -> None:
        c = self._keys[e.key].index % len(self._comms)
        # a blocking acquire (a completing allreduce releases it), woken every warn_after to warn
        while not self._slots.acquire(timeout=self._policy.warn_after):
            log.warning("concurrent kvstore: key %r has waited %.0fs for one of the %d outstanding "
                        "allreduces to finish (are the other ranks issuing the same keys?)",
                        e.key, self._policy.warn_after, self._outstanding)
        self._engine.push(functools.partial(self._run, c, e), mutates=[self._vars[c]], pool="comm",
                          name=f"allreduce({e.key!r})")

    def _run(self, c: int, e: Entry) -> None:
        err = None
        try:
            with after(e.buf, e.ready):
                self._reduce(self._comms[c], e.buf, poll=True, key=e.key)
                if e.finish is not None:
                    e.finish()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter by the tracker
            err = exc
        finally:
            self._slots.release()
            self._tracker.finish(e.key, err)

    def _shutdown(self) -> None:
        self._engine.close()
        for c in self._comms:
            c.free()
