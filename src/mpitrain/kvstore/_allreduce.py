"""The allreduce-based implementation shared by local, funnel, concurrent, depchain and dist_sync_mpi:
queued entries reduced over the workers, a tracker of what is outstanding, a rendezvous, the local
optimizer and compression. Semantics: see :mod:`mpitrain.kvstore._interface`."""

from __future__ import annotations

import abc
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .._utils.stall import StallPolicy, wait_until
from ..comm import ready_event
from ..comm.base import Communicator
from ..comm.reducer import ReducePolicy, Reducer
from ._interface import (
    Key,
    KeyInfo,
    KVStore,
    KVStoreError,
    Registry,
    Value,
    make_optimizer_factory,
    pairs,
    split_private,
    stall_policy,
    tensors,
)

__all__ = ["AllreduceStore", "Entry", "Tracker", "rendezvous"]


class Entry:
    """One queued reduction: sum `buf` over workers in place, then run `finish` (copy-outs, update).

    Made on the caller's thread once `buf` is filled: for a CUDA `buf`, `ready` is an event on the
    caller's current stream there, and the comm thread runs the reduction after it on a side stream
    (``comm._cuda.after``), so the caller's stream is never waited for as a whole."""

    __slots__ = ("key", "buf", "finish", "seq", "aux", "ready")

    def __init__(self, key: Key, buf: torch.Tensor, finish: Callable[[], None] | None) -> None:
        self.key, self.buf, self.finish, self.seq = key, buf, finish, 0
        self.aux: torch.Tensor | None = None  # a type's private buffer (depchain's comm buffer)
        self.ready = None if buf.is_cpu else ready_event(buf)


class Tracker:
    """Counts outstanding entries per key; ``wait`` blocks until the asked keys have none left."""

    def __init__(self, policy: StallPolicy) -> None:
        self._cv = threading.Condition()
        self._open: dict[Key, int] = {}
        self._errors: list[BaseException] = []  # from failed operations: raised once by wait
        self._fatal: BaseException | None = None  # the store is broken: every wait raises it
        # woken by finish(): the sleeps between checks only bound how late a stall warning comes
        self._policy = dataclasses.replace(policy, max_nap=0.05)

    def start(self, key: Key) -> None:
        with self._cv:
            self._open[key] = self._open.get(key, 0) + 1

    def finish(self, key: Key, error: BaseException | None = None) -> None:
        with self._cv:
            self._open[key] -= 1
            if error is not None:
                self._errors.append(error)
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        """Record an error that every later wait raises (a broken store)."""
        with self._cv:
            self._fatal = error
            self._cv.notify_all()

    @property
    def failed(self) -> bool:
        with self._cv:
            return self._fatal is not None

    def busy(self, keys: Iterable[Key] | None) -> list[Key]:
        with self._cv:
            return [k for k in (self._open if keys is None else keys) if self._open.get(k, 0)]

    def wait(self, keys: Sequence[Key] | None, what: str = "") -> None:
        """Block until no entry of `keys` (all if None) is open; every `warn_after` seconds one line
        names the keys still open, after `abort_after` seconds :class:`~mpitrain._utils.stall.StallError`.
        Then raise the first error of a failed operation (once), or the error that broke the store
        (always)."""
        def settled() -> bool:
            with self._cv:
                return self._fatal is not None or not self.busy(keys)

        wait_until(settled, lambda: f"keys {self.busy(keys)[:20]}", self._policy, who=f"kvstore{what}",
                   cv=self._cv)
        with self._cv:
            if self._fatal is not None:
                raise self._fatal
            if self._errors:
                err, self._errors = self._errors[0], []
                raise err


def rendezvous(comm: Communicator, what: str, policy: StallPolicy,
               abort: Callable[[int], None] | None = None) -> None:
    """Return once every rank of `comm` has called it (which ranks must call: all of `comm`, in the
    same order as their other collectives on it). Polls a 1-element nonblocking allreduce with sleeps
    (:func:`~mpitrain._utils.stall.wait_until`: 50 us of back-to-back tests, then sleeps backing off to
    0.2 ms), warning every `policy.warn_after` seconds, naming `what`, while some rank is missing, and
    calling ``abort(1)`` after `policy.abort_after` seconds."""
    req = comm.iallreduce(torch.zeros(1, dtype=torch.int32))
    wait_until(req.test, f"{what} (the other ranks to join: are they issuing the same keys in the same order?)",
               dataclasses.replace(policy, spin=5e-5, max_nap=2e-4), who=f"kvstore rank {comm.rank}", abort=abort)


class AllreduceStore(KVStore):
    """The shared implementation: each type says how a queued :class:`Entry` is reduced (``_enqueue``)."""

    def __init__(self, comm: Communicator, warn_after: float = 60.0, abort_after: float | None = 600.0,
                 ctl: Communicator | None = None) -> None:
        self._policy = stall_policy(warn_after, abort_after)
        self._world = comm
        # the workers' main-thread blocking collectives (init, broadcast, barrier)
        self._ctl = split_private(comm) if ctl is None else ctl
        self._registry = Registry(self._ctl)
        self._keys = self._registry.keys
        self._tracker = Tracker(self._policy)
        self._opt_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None
        self._opts: dict[Key, torch.optim.Optimizer] = {}
        self._push_bufs: dict[Key, list[torch.Tensor]] = {}  # idle push buffers per key
        self._buf_lock = threading.Lock()
        self._codec: Any = None
        self._reducers: dict[tuple[int, bool], Reducer] = {}  # by (id of the communicator, compressed)
        self._closed = False

    # -- identity --------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._ctl.rank

    @property
    def num_workers(self) -> int:
        return self._ctl.size

    # -- registration ----------------------------------------------------------------------------
    def init(self, key: Key | Sequence[Key], value: Value | Sequence[Value], *, pushpull_only: bool = False) -> None:
        """Collective over workers: register keys; rank 0's values become the stored values. With
        `pushpull_only` only the signatures are registered (no stored copy, no broadcast): the keys take
        ``pushpull``/``wait`` only (see :mod:`mpitrain.kvstore._interface`)."""
        self._check_open()
        items = self._registry.items(key, value)
        self.wait()
        for k in self._registry.register(items, keep=not pushpull_only):
            self._registered(k)

    def held_bytes(self) -> int:
        """Bytes of stored values this worker holds (0 for ``pushpull_only`` keys)."""
        return self._registry.held_bytes()

    def _registered(self, key: Key) -> None:  # noqa: B027 - optional hook
        """Hook: a key was registered (collectively, in the same order on every worker)."""

    def _info(self, key: Key, t: torch.Tensor | None, what: str) -> KeyInfo:
        return self._registry.info(key, t, what)

    # -- data operations -------------------------------------------------------------------------
    def pushpull(self, key: Key | Sequence[Key], ins: Value | Sequence[Value], outs: Any = None,
                 priority: int = 0) -> None:
        """Queue ``outs = sum over workers of ins``; returns at once (see :meth:`wait`). Every key
        of a list is checked before the first is queued."""
        self._check_open()
        out_pairs = pairs(key, outs, "pushpull outs") if outs is not None else None
        entries = []
        for i, (k, v) in enumerate(pairs(key, ins, "pushpull")):
            src = tensors(v, f"pushpull({k!r})")
            dst = tensors(out_pairs[i][1], f"pushpull({k!r}) outs") if out_pairs else src[:1]
            entries.append(self._pushpull_entry(k, src, dst))
        for e in entries:
            self._enqueue(e)

    def _pushpull_entry(self, key: Key, src: list[torch.Tensor], dst: list[torch.Tensor]) -> Entry:
        """The entry reducing in place into the first output, then copying to the others.
        Zero-copy when outs is ins."""
        self._check_pushpull(key, src, dst)
        first = dst[0]
        if first.is_contiguous() and all(s is not first for s in src[1:]):
            buf, rest = first, dst[1:]
            if src[0] is not first:
                buf.copy_(src[0])
            for s in src[1:]:
                buf.add_(s)
        else:
            buf, rest = _local_sum(src), dst
        return Entry(key, buf, functools.partial(_copy_to, buf, rest) if rest else None)

    def _check_pushpull(self, key: Key, src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
        self._check_tensor(key, src[0], "pushpull")
        for t in (*src[1:], *dst):
            if t.shape != src[0].shape or t.dtype != src[0].dtype:
                raise KVStoreError(f"pushpull({key!r}): every input and output must be {tuple(src[0].shape)} "
                                   f"{src[0].dtype} like the first input, got {tuple(t.shape)} {t.dtype}")

    def _check_tensor(self, key: Key, t: torch.Tensor, what: str) -> None:
        """Types that need init check the signature; dist_sync_mpi negotiates it instead."""
        self._info(key, t, what)
        self._check_codec(key, t, what)

    def _check_codec(self, key: Key, t: torch.Tensor, what: str) -> None:
        """A value the compression codec cannot encode is refused here, before anything is queued."""
        if self._codec is not None and t.is_floating_point():
            from ..comm.base import CommError
            try:
                self._codec.check_input(t, f"{what}({key!r})")
            except CommError as e:
                raise KVStoreError(str(e)) from e

    def push(self, key: Key | Sequence[Key], value: Value | Sequence[Value], priority: int = 0) -> None:
        """Queue: stored value = sum over workers (or, with an optimizer, one step with that sum).
        The value is copied at once into a private buffer, so the caller may reuse it."""
        self._check_open()
        items = [(k, tensors(v, f"push({k!r})")) for k, v in pairs(key, value, "push")]
        # all checked before any is queued (a pushpull_only key has no stored value to reduce into)
        stores = [self._registry.value(k, src[0], "push") for k, src in items]
        for k, src in items:
            self._check_codec(k, src[0], "push")
        for (k, src), store in zip(items, stores):
            with self._buf_lock:
                free = self._push_bufs.setdefault(k, [])
                buf = free.pop() if free else torch.empty_like(store)
            buf.copy_(src[0])
            for s in src[1:]:
                buf.add_(s)
            self._enqueue(Entry(k, buf, functools.partial(self._after_push, k, store, buf)))

    def _after_push(self, key: Key, store: torch.Tensor, summed: torch.Tensor) -> None:
        """Runs where the reduction completed: store the sum or step the optimizer with it."""
        try:
            if self._opt_factory is None:
                store.copy_(summed)
            else:
                opt = self._opts.get(key)
                if opt is None:
                    opt = self._opts[key] = self._opt_factory([store])
                store.grad = summed
                opt.step()
                store.grad = None
        finally:
            with self._buf_lock:
                self._push_bufs[key].append(summed)

    def pull(self, key: Key | Sequence[Key], out: Any = None, priority: int = 0,
             ignore_sparse: bool = True) -> None:
        """Copy the stored value into `out` (a tensor or list) once earlier pushes of the key are done.
        Returns with `out` complete (it waits for the key)."""
        self._check_open()
        items = pairs(key, out, "pull")
        for k, o in items:
            if o is None:
                raise KVStoreError(f"pull({k!r}): pass `out`, the tensor(s) to copy the value into")
            for t in tensors(o, f"pull({k!r})"):
                self._registry.value(k, t, "pull")  # refuses a pushpull_only key before any wait
        self.wait([k for k, _ in items])
        for k, o in items:
            for t in tensors(o, f"pull({k!r})"):
                t.copy_(self._registry.value(k, t, "pull"))

    def broadcast(self, key: Key | Sequence[Key], value: Value | Sequence[Value], out: Any,
                  root_rank: int = 0, priority: int = 0) -> None:
        """Collective: initialize `key` (if new) with root's `value` and copy it into `out` on every
        worker. Blocking: completes outstanding operations first, returns with `out` filled."""
        self._check_open()
        self._ctl._check_rank(root_rank, "root_rank")
        new = self._registry.new_keys(key, value, "broadcast")
        if new:
            self.init([k for k, _ in new], [v for _, v in new])
        self.wait()
        self._registry.broadcast(key, value, out, root_rank)

    def barrier(self) -> None:
        """Complete this worker's outstanding operations, then a barrier over the workers."""
        self.wait()
        self._ctl.barrier()

    def wait(self, keys: Key | Sequence[Key] | None = None) -> None:
        """Return once every operation issued so far on `keys` (all keys if None) is complete.

        Collective for the sequenced types (funnel, concurrent, depchain): it releases the operations
        still held back, so every worker must reach it at the same point of its operation sequence.
        """
        ks = None if keys is None else [k for k, _ in pairs(keys, None, "wait")]
        self._flush()
        self._drain(ks)
        self._tracker.wait(ks, f" {self.type}")

    # -- optimizer and compression ---------------------------------------------------------------
    def set_optimizer(self, optimizer: Any) -> None:
        """Later ``push`` steps the stored value with the summed gradient (replicated on every worker,
        identical everywhere). Takes an optimizer instance (class + defaults reused) or a factory."""
        self._check_open()
        self.wait()
        self._opt_factory = make_optimizer_factory(optimizer)
        self._opts.clear()

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Collective: rank 0 writes every key's optimizer state (identical on all workers) to `fname`."""
        if self._opt_factory is None:
            raise KVStoreError("save_optimizer_states: no optimizer set (call set_optimizer first)")
        self.wait()
        if self.rank == 0:
            torch.save({k: o.state_dict() for k, o in self._opts.items()}, fname)
        self._ctl.barrier()

    def load_optimizer_states(self, fname: str) -> None:
        """Every worker reads `fname` (written by save_optimizer_states) into its optimizers."""
        if self._opt_factory is None:
            raise KVStoreError("load_optimizer_states: no optimizer set (call set_optimizer first)")
        self.wait()
        for k, state in torch.load(fname, weights_only=False).items():
            store = self._registry.value(k, None, "load_optimizer_states")
            opt = self._opts.get(k)
            if opt is None:
                opt = self._opts[k] = self._opt_factory([store])
            opt.load_state_dict(state)

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress every later reduction with codec ``compression_params["type"]`` (bf16, fp16, int8)
        over the ring allreduce of :mod:`mpitrain.comm.ring`. Lossy: results are no longer exact sums."""
        self._check_open()
        if not isinstance(compression_params, dict) or "type" not in compression_params:
            raise KVStoreError("set_gradient_compression takes a dict like {'type': 'bf16'}")
        from ..comm.base import CommError
        from ..comm.codecs import get_codec

        name = compression_params["type"]
        try:
            codec = get_codec(name)
        except CommError as e:
            raise KVStoreError(f"set_gradient_compression: {e}") from e
        self._registry.check_same([str(name)], "set_gradient_compression")
        self.wait()
        self._codec = None if codec.name is None else codec

    def _reduce(self, comm: Communicator, buf: torch.Tensor, poll: bool = False, key: Key | None = None) -> None:
        """Sum `buf` over `comm` in place through the gradient reducer: plain allreduce, or the compressed
        ring allreduce.

        ``poll=True`` (background threads that may start before the peers are ready) first meets the
        peers in a 1-element nonblocking allreduce completed with sleeping tests, then runs the blocking
        allreduce: waiting for a slower peer never busy-waits on the core it needs to finish its
        backward pass, and the data moves with MPI's tuned blocking algorithm, faster than a polled
        nonblocking allreduce of the same buffer (Open MPI's nonblocking collectives only progress
        inside a test, so sleeping between tests stretches every round of a large reduction; measured,
        dated: docs/engine-kvstore.md, "Performance", item 1). The MPI Communicator reduces a large
        buffer as consecutive pieces (comm/_mpi.py)."""
        compressed = self._codec is not None and buf.is_floating_point()
        if poll and not compressed:
            rendezvous(comm, f"{self.type} allreduce of key {key!r}", self._policy, self._world.abort)
        self._reducer(comm, compressed).reduce([buf])

    def _reducer(self, comm: Communicator, compressed: bool) -> Reducer:
        """The gradient reducer's blocking form on `comm` (:class:`~mpitrain.comm.reducer.Reducer`: flat sum,
        or the compressed ring with the store's codec), one per communicator and policy. Its blocking
        allreduce only warns when late: the store's own waits (tracker, rendezvous, coordinator cycles)
        decide when the job ends, as they did before the reducer."""
        with self._buf_lock:
            reducer = self._reducers.get((id(comm), compressed))
            if reducer is None or reducer.comm is not comm or (compressed and reducer.policy.codec is not self._codec):
                policy = (ReducePolicy("compressed", op="sum", codec=self._codec) if compressed
                          else ReducePolicy("flat", op="sum"))
                warn_only = dataclasses.replace(self._policy, abort_after=None)
                reducer = self._reducers[(id(comm), compressed)] = Reducer(comm, policy, warn_only,
                                                                           name=f"kvstore {self.type}")
            return reducer

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Collective: complete everything and release threads and communicators (idempotent)."""
        if self._closed:
            return
        try:
            if not self._tracker.failed:  # a failed store already reported its error
                self.wait()
        finally:
            self._closed = True
            self._shutdown()
            self._ctl.free()

    def _shutdown(self) -> None:  # noqa: B027 - optional hook
        """Hook: stop threads, free communicators."""

    def _check_open(self) -> None:
        if self._closed:
            raise KVStoreError(f"this {self.type} kvstore is closed")

    # -- what a type implements ------------------------------------------------------------------
    @abc.abstractmethod
    def _enqueue(self, entry: Entry) -> None:
        """Start summing ``entry.buf`` over workers; call ``entry.finish`` after; track completion."""

    def _flush(self) -> None:  # noqa: B027 - optional hook
        """Release operations held back for ordering (sequenced types); a no-op otherwise."""

    def _drain(self, keys: list[Key] | None) -> None:  # noqa: B027 - optional hook
        """Hook for ``wait``: make progress on `keys` in the waiting thread (engine types run their
        queued reductions here instead of sleeping while a comm thread wakes up); a no-op otherwise."""


def _copy_to(src: torch.Tensor, dsts: list[torch.Tensor]) -> None:
    for d in dsts:
        d.copy_(src)


def _local_sum(ts: list[torch.Tensor]) -> torch.Tensor:
    out = ts[0].detach().clone(memory_format=torch.contiguous_format)  # on the inputs' device
    for t in ts[1:]:
        out.add_(t)
    return out
