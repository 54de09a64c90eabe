"""The `depchain` KVStore (DAG paper §4.3): push copies to a comm buffer, pull chains the allreduce."""

from __future__ import annotations

import functools

import torch

from ..comm import after
from ..comm.base import Communicator
from ..engine import Engine, Var
from ._allreduce import Entry, _copy_to
from ._interface import Key, split_private
from ._sequencer import SequencedStore

__all__ = ["DepChainStore"]


class DepChainStore(SequencedStore):
    """Ordering: every allreduce task mutates one shared dummy variable, so the engine runs them one
    at a time in the order they were pushed, and the :class:`Sequencer` pushes them in init-key order
    on every worker. The push half (a copy into the key's communication buffer) runs at once on the
    caller's thread; the allreduce and the copy back into the output run on the engine's comm thread,
    overlapping whatever the caller does next.

    ``copy_inputs=False`` drops the copy for ``pushpull(key, buf)`` with `outs` the same single tensor
    as `ins`: the allreduce then sums `buf` in place, saving two passes over it, and the caller must not
    touch `buf` until ``wait`` covers the key (DataParallel's gradient buckets opt in). The default
    keeps the design's copy, so a general caller may reuse its input as soon as ``pushpull`` returns."""

    type = "depchain"
    poll = True

    def __init__(self, comm: Communicator, warn_after: float = 60.0, abort_after: float | None = 600.0,
                 copy_inputs: bool = True) -> None:
        super().__init__(comm, warn_after, abort_after)
        self._copy_inputs = copy_inputs
        self._data = split_private(comm)
        self._engine = Engine({"comm": 1}, warn_after=warn_after)
        self._dummy = Var("depchain-order")
        self._vars: dict = {}
        self._free: dict = {}  # key -> idle communication buffers

    def _registered(self, key: Key) -> None:
        super()._registered(key)
        self._vars[key] = Var(f"key{key!r}")
        self._free[key] = []  # comm buffers are made on the first push's device, then reused

    def _pushpull_entry(self, key: Key, src: list[torch.Tensor], dst: list[torch.Tensor]) -> Entry:
        """The push: the inputs go straight into the key's communication buffer (one copy; the
        caller may reuse them at once); the pull copies the sum back into every output."""
        if not self._copy_inputs and len(src) == 1 and len(dst) == 1 and dst[0] is src[0]:
            return super()._pushpull_entry(key, src, dst)  # in place; _enqueue makes buf the comm buffer
        self._check_pushpull(key, src, dst)
        with self._lock:
            free = self._free[key]
            comm_buf = free.pop() if free else torch.empty_like(src[0], memory_format=torch.contiguous_format)
        comm_buf.copy_(src[0])
        for s in src[1:]:
            comm_buf.add_(s)
        entry = Entry(key, dst[0], functools.partial(_copy_to, comm_buf, dst[1:]) if len(dst) > 1 else None)
        entry.aux = comm_buf
        return entry

    def _arriving(self, entry: Entry) -> None:
        if entry.aux is None:  # from push: its private buffer serves as the communication buffer
            entry.aux = entry.buf

    def _drain(self, keys: list[Key] | None) -> None:
        """The waiting thread runs the queued allreduce tasks itself (the engine's ``help``): still one
        at a time and in push order, since each becomes runnable only when the previous one finished."""
        for var in [self._dummy] if keys is None else [self._vars[k] for k in keys if k in self._vars]:
            self._engine.wait(var, help="comm")

    def _dispatch(self, e: Entry) -> None:
        buf = e.buf if e.aux is None else e.aux  # _arriving set aux; e.buf is its own default
        self._engine.push(functools.partial(self._pull, e, buf), mutates=[self._vars[e.key], self._dummy],
                          pool="comm", name=f"allreduce({e.key!r})")

    def _pull(self, e: Entry, buf: torch.Tensor) -> None:
        err = None
        try:
            with after(e.buf, e.ready):
                self._reduce(self._data, buf, poll=self.poll, key=e.key)
                if buf is not e.buf:
                    e.buf.copy_(buf)
                if e.finish is not None:
                    e.finish()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter by the tracker
            err = exc
        finally:
            if buf is not e.buf:
                with self._lock:
                    self._free[e.key].append(buf)
            self._tracker.finish(e.key, err)

    def _shutdown(self) -> None:
        self._engine.close()
        self._data.free()

