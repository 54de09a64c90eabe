"""The `funnel` KVStore (DAG paper §4.1): the main thread issues every allreduce itself."""

from __future__ import annotations

from ..comm import after
from ..comm.base import Communicator
from ._allreduce import Entry
from ._interface import split_private
from ._sequencer import SequencedStore

__all__ = ["FunnelStore"]


class FunnelStore(SequencedStore):
    """Ordering: the calling thread runs each blocking allreduce at the moment the :class:`Sequencer`
    releases it, so every worker issues them in init-key order. One collective in flight at a time;
    ``pushpull`` may block while it runs (that is the design: no communication thread)."""

    type = "funnel"

    def __init__(self, comm: Communicator, warn_after: float = 60.0, abort_after: float | None = 600.0) -> None:
        super().__init__(comm, warn_after, abort_after)
        self._data = split_private(comm)

    def _dispatch(self, e: Entry) -> None:
        err = None
        try:
            with after(e.buf, e.ready):
                self._reduce(self._data, e.buf)
                if e.finish is not None:
                    e.finish()
        except BaseException as exc:  # noqa: BLE001 - raised by the next wait, like the other types
            err = exc
        self._tracker.finish(e.key, err)

    def _shutdown(self) -> None:
        self._data.free()
