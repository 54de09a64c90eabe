"""The `dist_sync_mpi` KVStore: a comm thread per rank negotiates, Horovod-style, which keys to reduce.

Each cycle, every rank's comm thread contributes one row to a small int32 matrix summed by a
nonblocking allreduce (so every rank learns every rank's state): flags (has new announcements,
pending entries, wants to close) and one readiness bit per *cached* key. A key ready on every rank
is reduced in the same cycle on every rank, in cache-slot order. A key not yet in the cache (first
use, or a new shape/dtype) is announced with its signature in one pickled allgather; the decision
(accept into the cache, or a mismatch error naming the key, the signatures and the ranks) is a pure
function of the gathered announcements, so every rank computes the coordinator's (rank 0's) answer
itself and all of them raise the same error. In steady state a step costs one tiny int allreduce per
cycle and no pickling. Rank 0 reports stalls (a key ready on some ranks only) after `warn_after`
seconds and ends the job after `abort_after` seconds with the same message.

Pacing: a rank posts its next cycle at once while it has work queued (the cycle then waits, polled
with sleeps, for the ranks that have none yet, so their push completes it); a rank with nothing
queued sits out until a local push or for at most 50 ms (which keeps the watchdog and ``close``
informed). A caller blocked in ``wait`` runs the cycles itself (one thread at a time holds the turn),
and the data allreduces are MPI's blocking ones: every rank has just agreed to run them. With
``lazy_thread=True`` the comm thread starts at the first negotiated operation (or at ``close``) instead of
at construction, so a store used only through its declared order (below) runs no cycle at all.

Declared order (:meth:`CoordinatorStore.declare_order`, issue #29 item 1): a caller that pushes some keys
in one fixed order every round on every rank (DataParallel's buckets) declares them once; their
``pushpull`` then goes straight to a :class:`~mpitrain.comm.reducer.Reducer` (one worker thread, the keys
registered in the declared order, on a private communicator of its own) with no negotiation cycle.
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from .._utils.flat import copy_from_flat, flatten
from .._utils.stall import Backoff, StallPolicy, say, wait_until
from ..comm import after
from ..comm.base import CommError, Communicator, Request
from ..comm.codecs import Codec
from ..comm.reducer import Bucket, Handle, ReduceError, ReducePolicy, Reducer
from ._allreduce import AllreduceStore, Entry
from ._interface import Key, KVStoreError, Value, check_key, log, pairs, split_private, tensors

__all__ = ["CoordinatorStore"]

_FLAGS = 3  # columns before the readiness bits: announce, pending count, close requested
Sig = tuple[tuple[int, ...], str]
_GRACE = 2e-4  # after a local push, how long the comm thread lets the caller reach wait and run the cycle


class CoordinatorStore(AllreduceStore):
    """Ordering: every rank reduces exactly the keys the shared cycle matrix says are ready on all
    ranks, in cache-slot order, on one comm thread; so the order is identical by construction and
    ranks may push keys in any order. ``pushpull`` needs no ``init`` (the first use negotiates).
    Consecutive ready keys of one dtype totalling at most `fusion_bytes` are reduced as one fused
    allreduce (one copy in and out of a reused buffer); larger keys are reduced in place, no copy.
    Keys declared with :meth:`declare_order` are not negotiated: the reducer posts them in the declared
    order, the same on every rank by the declaration's check, on its own communicator.
    `lazy_thread`: start the comm thread at the first negotiated operation (see the module docstring)."""

    type = "dist_sync_mpi"

    def __init__(self, comm: Communicator, warn_after: float = 60.0, abort_after: float | None = 300.0,
                 fusion_bytes: int = 1 << 20, lazy_thread: bool = False) -> None:
        if fusion_bytes < 0:
            raise KVStoreError(f"fusion_bytes must be >= 0, got {fusion_bytes}")
        super().__init__(comm, warn_after, abort_after)
        self._data = split_private(comm)
        # the negotiation cycle's wait: 50 us of back-to-back tests, then sleeps backing off to 0.25 ms
        self._cycle_policy = dataclasses.replace(self._policy, spin=5e-5, max_nap=2.5e-4)
        self._fusion_bytes = fusion_bytes
        self._fusion: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # reusable, per dtype and device
        self._cv = threading.Condition()
        self._pending: dict[Key, deque[Entry]] = {}
        self._slots: list[tuple[Key, Sig]] = []  # the response cache, identical on every rank
        self._slot_of: dict[Key, int] = {}
        self._since: dict[Key, float] = {}  # first cycle a key was seen ready on some ranks only
        self._reported: set[Key] = set()
        self._close_requested = False
        self._arrivals = 0  # bumped by every local push and by close: wakes a pausing comm thread
        self._seen = 0
        self._turn = threading.Lock()  # held while a thread runs a cycle (see _take_turn)
        self._finished = False  # the cycles ended on every rank
        self._draining = 0  # callers running cycles in wait (the comm thread pauses meanwhile)
        #: negotiation cycles this rank has run (the comm thread's and draining callers'): 0 while the store
        #: is used only through its declared order
        self.cycles = 0
        # lazy_thread: started by the first negotiated operation or by close (every rank's first cycle
        # meets the others' first, whenever each starts: the cycles are one sequence per rank). Eager by
        # default: a rank that never pushes a key then still cycles, so rank 0 reports that key missing
        # on it by name; a lazy rank that never starts shows as a negotiation cycle not answered.
        self._thread = threading.Thread(target=self._loop, name="kvstore-coordinator", daemon=True)
        self._declared: _Declared | None = None
        if not lazy_thread:
            self._thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    def _check_tensor(self, key: Key, t: torch.Tensor, what: str) -> None:
        if not t.is_contiguous():
            raise KVStoreError(f"{what}({key!r}): tensors must be contiguous (pass t.contiguous())")
        self._check_codec(key, t, what)

    def _start_thread(self) -> None:
        """Start the comm thread once (under ``self._cv``): the first negotiated operation, or close."""
        if self._thread.ident is None:
            self._thread.start()

    def _enqueue(self, entry: Entry) -> None:
        with self._cv:
            self._start_thread()
            if not self._thread.is_alive():
                raise KVStoreError("the dist_sync_mpi comm thread has stopped (an earlier error)")
            self._tracker.start(entry.key)
            self._pending.setdefault(entry.key, deque()).append(entry)
            self._arrivals += 1
            self._cv.notify()

    # -- the declared order ---------------------------------------------------------------------
    def declare_order(self, keys: Sequence[Key], values: Sequence[torch.Tensor]) -> None:
        """Collective over the workers (every worker calls it once, at the same point of its operations
        on this store, with the same keys in the same order): from now on each round ``pushpull(k, v)``
        of a declared key `k`, with ``v`` its declared tensor summed in place (`outs` omitted or ``v``),
        goes straight to the gradient reducer, posted in the declared order with no negotiation cycle.

        `keys` must be initialized (:meth:`init`) and `values[i]` is the contiguous tensor pushed under
        ``keys[i]`` every round (its shape and dtype those of ``init``; any device). Each round every
        worker must push every declared key exactly once (in any order: a key pushed early is held
        until the keys declared before it are pushed) and ``wait`` before pushing a key again.

        Checked before any data moves, with one pickled allgather: every worker raises the same
        :class:`KVStoreError` if any worker's arguments are wrong (naming its rank and what) or the
        workers declared different keys, order, shapes, dtypes or device types. Other keys, and
        ``push``/``pull`` of declared keys, keep the negotiated path."""
        self._check_open()
        error, sig = self._declaration(keys, values)
        self._registry.check_same(sig, "declare_order", error)
        # split from the store's communicator, not from _ctl: the torch backend splits only the world
        self._declared = _Declared(split_private(self._world), list(keys), list(values), self._policy, self._codec)

    def _declaration(self, keys: Sequence[Key], values: Sequence[torch.Tensor]
                     ) -> tuple[str | None, list[tuple[Key, tuple[int, ...], str]]]:
        """This worker's (error or None, signature) for :meth:`declare_order`: local checks only."""
        if self._declared is not None:
            return "declare_order was already called on this store", []
        if not isinstance(keys, (list, tuple)) or not isinstance(values, (list, tuple)) or len(keys) != len(values):
            return "keys and values must be lists of the same length", []
        try:  # every check local, so a bad argument on one rank reaches the others as its error
            if not keys or len(set(check_key(k) for k in keys)) != len(keys):
                raise KVStoreError(f"keys must be a non-empty list without repeats, got {list(keys)!r}")
            for k, v in zip(keys, values):
                if not isinstance(v, torch.Tensor) or not v.is_contiguous():
                    raise KVStoreError(f"declare_order({k!r}): the value must be one contiguous tensor")
                self._info(k, v, "declare_order")
        except KVStoreError as e:
            return str(e), []
        return None, [(k, *_signature(v)) for k, v in zip(keys, values)]

    def pushpull(self, key: Key | Sequence[Key], ins: Value | Sequence[Value], outs: Any = None,
                 priority: int = 0) -> None:
        """As :meth:`AllreduceStore.pushpull`; a declared key (:meth:`declare_order`) goes to the reducer."""
        declared = self._declared
        if declared is None:
            super().pushpull(key, ins, outs, priority)
            return
        self._check_open()
        items = pairs(key, ins, "pushpull")
        out_items = pairs(key, outs, "pushpull outs") if outs is not None else [(k, None) for k, _ in items]
        mine = [(k, v, o) for (k, v), (_, o) in zip(items, out_items) if k in declared.buckets]
        if len({k for k, _, _ in mine}) != len(mine):
            raise KVStoreError("pushpull: a declared key goes once per round; this list repeats one")
        for k, v, o in mine:  # every declared key checked before any is submitted
            declared.check(k, v, o)
        rest = [(k, v, o) for (k, v), (_, o) in zip(items, out_items) if k not in declared.buckets]
        if rest:
            super().pushpull([k for k, _, _ in rest], [v for _, v, _ in rest],
                             None if outs is None else [o for _, _, o in rest], priority)
        for k, _, _ in mine:
            declared.submit(k)

    def wait(self, keys: Key | Sequence[Key] | None = None) -> None:
        """As :meth:`AllreduceStore.wait`; declared keys are waited through the reducer's handles (its
        stall policy: a warning every ``warn_after``, the job ended after ``abort_after``)."""
        declared = self._declared
        if declared is None:
            super().wait(keys)
            return
        ks = None if keys is None else [k for k, _ in pairs(keys, None, "wait")]
        declared.wait(ks)
        rest = None if ks is None else [k for k in ks if k not in declared.buckets]
        if rest is None or rest:
            super().wait(rest)

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """As :meth:`AllreduceStore.set_gradient_compression`; the declared keys' reducer takes the codec too."""
        super().set_gradient_compression(compression_params)
        if self._declared is not None:
            self._declared.set_codec(self._codec)

    # -- the comm thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        pause, woken = _backoff(), lambda: self._arrivals != self._seen
        idle_wait = min(0.05, self._policy.warn_after / 4)
        while True:
            if self._draining:  # a caller blocked in wait runs the cycles: stay out of its way
                with self._cv:
                    self._cv.wait_for(lambda: not self._draining, idle_wait)
                continue
            result = self._take_turn()
            if result is None:
                return
            progressed, active, _ = result
            if progressed:
                pause.reset()
            elif not active[self._data.rank]:
                # Nothing queued here: sit out until a local push. The ranks with work keep their next
                # cycle posted, so our push completes it at once (one cycle of latency, no idle
                # polling). The timeout keeps the stall watchdog and close informed.
                with self._cv:
                    pushed = self._cv.wait_for(woken, idle_wait)
                if pushed:  # a caller that waits right after pushing gets the turn (see _drain)
                    time.sleep(_GRACE)
            elif all(active):  # everyone has work but nothing matched (different orders): back off
                pause.sleep(self._cv, woken)
            # else: post the next cycle now and wait in it for the ranks that have nothing queued

    def _take_turn(self) -> tuple[bool, list[bool], bool] | None:
        """Run one cycle, on whichever thread calls (the comm thread, or a caller blocked in ``wait``;
        the turn lock keeps it to one at a time, so this rank's cycles stay one sequence). None once
        the cycles have ended on every rank (close, or a mismatch error)."""
        with self._turn:
            if self._finished:
                return None
            try:
                result = self._cycle()
            except BaseException as e:  # noqa: BLE001 - the other ranks are in our collectives: end the job
                log.error("dist_sync_mpi cycle on rank %d failed: %r; aborting the job", self.rank, e)
                self._tracker.fail(e)
                self._world.abort(1)
                raise
            self._finished = result[2]
            return None if self._finished else result

    def _drain(self, keys: list[Key] | None) -> None:
        """The waiting caller runs the cycles itself until its keys are done, instead of sleeping while
        the comm thread wakes up for them (two thread wake-ups per step saved)."""
        pause = _backoff()
        with self._cv:
            self._draining += 1
        try:
            while self._tracker.busy(keys) and not self._tracker.failed:
                result = self._take_turn()
                if result is None:
                    return
                progressed, active, _ = result
                if not progressed and all(active):
                    pause.sleep(self._cv, lambda: False)
        finally:
            with self._cv:
                self._draining -= 1
                self._cv.notify_all()

    def _cycle(self) -> tuple[bool, list[bool], bool]:
        """One negotiation + execution round. Returns (ran something, which ranks have work queued or
        are closing, finished)."""
        self.cycles += 1
        row, announce = self._local_state()
        size, rank = self._data.size, self._data.rank
        table = torch.zeros((size, len(row)), dtype=torch.int32)
        table[rank] = torch.tensor(row, dtype=torch.int32)
        self._poll_cycle(self._data.iallreduce(table))
        bits = table[:, _FLAGS:]
        ready = (bits.sum(0) == size).nonzero().flatten().tolist()
        run = [self._slots[s][0] for s in ready]
        waiting: dict[Key, list[int]] = {}
        if table[:, 0].any():
            accepted, waiting, error = self._negotiate(announce, bits)
            if error is not None:
                self._fail_all(error)
                return False, [], True
            run += accepted
        self._execute(run)
        self._watch_stalls(table, waiting)
        busy = bool(table[:, 1].any())
        active = ((table[:, 1] > 0) | (table[:, 2] > 0)).tolist()
        return bool(run), active, bool(table[:, 2].all()) and not busy

    def _poll_cycle(self, req: Request) -> None:
        """Complete the cycle's allreduce, sleeping between tests. A peer whose comm thread does not
        join (its process is blocked or gone) gets a warning every warn_after seconds and ends the job
        after abort_after: this wait, too, has a way out."""
        wait_until(req.test, "the negotiation cycle: a rank's comm thread is not responding (its process "
                   "is blocked or gone)", self._cycle_policy, who=f"dist_sync_mpi rank {self._data.rank}",
                   abort=self._world.abort)

    def _local_state(self) -> tuple[list[int], list[tuple[Key, Sig]]]:
        """This rank's row (flags + readiness bits) and announcements of uncached heads."""
        bits = [0] * len(self._slots)
        announce = []
        with self._cv:
            npending = sum(len(q) for q in self._pending.values())
            for key, q in self._pending.items():
                if not q:
                    continue
                sig = _signature(q[0].buf)
                slot = self._slot_of.get(key)
                if slot is not None and self._slots[slot][1] == sig:
                    bits[slot] = 1
                else:
                    announce.append((key, sig))
            closing = self._close_requested
            self._seen = self._arrivals
        return [int(bool(announce)), min(npending, 1 << 30), int(closing), *bits], announce

    def _negotiate(self, announce: list[tuple[Key, Sig]], bits: torch.Tensor
                   ) -> tuple[list[Key], dict[Key, list[int]], KVStoreError | None]:
        """Gather announcements; accept keys announced identically by every rank (new cache slots in a
        deterministic order), or return the mismatch error every rank raises. Also returns the keys
        announced by some ranks only, with the ranks still missing."""
        everyone = self._data.allgather_object(announce)
        sigs: dict[Key, dict[int, Sig]] = {}
        for r, items in enumerate(everyone):
            for key, sig in items:
                sigs.setdefault(key, {})[r] = sig
        accepted, waiting = [], {}
        for key, by_rank in sigs.items():
            slot = self._slot_of.get(key)
            if slot is not None:  # ranks whose head matches the cached signature count as announcing it
                for r in range(self._data.size):
                    if r not in by_rank and bits[r, slot]:
                        by_rank[r] = self._slots[slot][1]
            if len(set(by_rank.values())) > 1:
                return [], {}, _mismatch(key, by_rank, self._data.size)
            if len(by_rank) < self._data.size:
                waiting[key] = [r for r in range(self._data.size) if r not in by_rank]
            else:
                sig = next(iter(by_rank.values()))
                if slot is None:
                    self._slot_of[key] = len(self._slots)
                    self._slots.append((key, sig))
                else:
                    self._slots[slot] = (key, sig)
                accepted.append(key)
        return accepted, waiting, None

    def _execute(self, keys: list[Key]) -> None:
        """Reduce the head entry of each key, in order. Consecutive small entries of one dtype are
        fused into one allreduce (Horovod's tensor fusion): the grouping depends only on the agreed
        order and signatures, so every rank fuses alike."""
        with self._cv:
            entries = [self._pending[k].popleft() for k in keys]
        for k in keys:
            self._since.pop(k, None)
            self._reported.discard(k)
        for group in _fusion_groups(entries, self._fusion_bytes):
            err = None
            try:
                with after(group[0].buf, *(e.ready for e in group)):
                    self._reduce_group(group)
                    for e in group:
                        if e.finish is not None:
                            e.finish()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiters by the tracker
                err = exc
            for e in group:
                self._tracker.finish(e.key, err)

    def _reduce_group(self, group: list[Entry]) -> None:
        # Blocking allreduce, no rendezvous: every rank's comm thread has just completed this cycle's
        # negotiation, which marked these keys ready everywhere, so the peers are already on their way
        # into the same call and the busy-wait is short.
        if len(group) == 1:
            self._reduce(self._data, group[0].buf)
            return
        sizes = [e.buf.numel() for e in group]
        total, dtype, dev = sum(sizes), group[0].buf.dtype, group[0].buf.device
        buf = self._fusion.get((dtype, dev))
        if buf is None or buf.numel() < total:
            size = max(total, self._fusion_bytes // _itemsize(dtype))
            buf = self._fusion[(dtype, dev)] = torch.empty(size, dtype=dtype, device=dev)
        flat = flatten([e.buf for e in group], out=buf)
        self._reduce(self._data, flat)
        copy_from_flat(flat, [e.buf for e in group])

    def _fail_all(self, error: KVStoreError) -> None:
        """A global error (every rank computed it): fail every pending entry, stop the thread."""
        self._tracker.fail(error)
        with self._cv:
            for key, q in self._pending.items():
                while q:
                    q.popleft()
                    self._tracker.finish(key)

    # -- stall watchdog --------------------------------------------------------------------------
    def _watch_stalls(self, table: torch.Tensor, waiting: dict[Key, list[int]]) -> None:
        """Track keys ready on some ranks only; rank 0 warns after warn_after, aborts after abort_after."""
        size = self._data.size
        partial: dict[Key, list[int]] = {}
        counts = table[:, _FLAGS:].sum(0)
        for s in ((counts > 0) & (counts < size)).nonzero().flatten().tolist():
            key = self._slots[s][0]
            partial[key] = [r for r in range(size) if not table[r, _FLAGS + s]]
        for key, missing in waiting.items():
            partial.setdefault(key, missing)
        now = time.monotonic()
        for key in list(self._since):
            if key not in partial:
                del self._since[key]
                self._reported.discard(key)
        for key in partial:
            self._since.setdefault(key, now)
        if self._data.rank == 0:
            self._report(partial, now)

    def _report(self, partial: dict[Key, list[int]], now: float) -> None:
        late = {k: partial[k] for k, t in self._since.items() if now - t >= self._policy.warn_after}
        if not late:
            return
        waited = max(now - self._since[k] for k in late)
        text = "; ".join(f"key {k!r} missing on ranks {r}" for k, r in sorted(late.items(), key=str)[:20])
        abort_after = self._policy.abort_after
        if abort_after is not None and waited >= abort_after:
            msg = f"dist_sync_mpi stall: {text} for {waited:.0f}s (> abort_after={abort_after}s); ending the job"
            log.error(msg)
            say(f"[mpitrain] {msg}")
            self._world.abort(1)
        fresh = [k for k in late if k not in self._reported]
        if fresh:
            self._reported.update(fresh)
            log.warning("dist_sync_mpi stall: %s for %.0fs (other ranks ready; will end the job after %ss)",
                        text, waited, abort_after)

    # -- lifecycle -------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        if self._declared is not None:
            self._declared.close()
        with self._cv:
            self._start_thread()  # the closing cycles: another rank's thread may be waiting in its first
            self._close_requested = True
            self._arrivals += 1
            self._cv.notify()
        while self._thread.is_alive():
            self._thread.join(self._policy.warn_after)
            if self._thread.is_alive():
                log.warning("dist_sync_mpi close on rank %d: waiting for the other ranks to close", self.rank)
        self._data.free()


class _Declared:
    """The declared keys of a store: a reducer with one worker thread on its own communicator `comm`
    (the coordinator's thread keeps cycling on the store's data communicator meanwhile), one bucket per
    key registered in the declared order, and the handle of each key pushed and not yet waited."""

    def __init__(self, comm: Communicator, keys: list[Key], values: list[torch.Tensor], policy: StallPolicy,
                 codec: Codec | None) -> None:
        self.comm, self.policy = comm, policy
        self.value_of = dict(zip(keys, values))  # in the declared order
        self.keys = keys
        self.handles: dict[Key, Handle] = {}
        self.reducer, self.buckets = self._build(codec)

    def _build(self, codec: Codec | None) -> tuple[Reducer, dict[Key, Bucket]]:
        """A reducer (flat sum, or the compressed ring when a codec is set) with every key registered."""
        kind = (ReducePolicy("compressed", op="sum", codec=codec) if codec is not None
                else ReducePolicy("flat", op="sum"))
        reducer = Reducer(self.comm, kind, self.policy, thread=True, name="kvstore dist_sync_mpi (declared)")
        buckets = {k: reducer.register([v]) for k, v in self.value_of.items()}
        return reducer, buckets

    def check(self, key: Key, value: Any, out: Any) -> None:
        """Local: `value` (and `out`, if given) is the declared tensor, and `key` is not in flight."""
        v = tensors(value, f"pushpull({key!r})")
        o = None if out is None else tensors(out, f"pushpull({key!r}) outs")
        declared = self.value_of[key]
        if len(v) != 1 or v[0] is not declared or (o is not None and (len(o) != 1 or o[0] is not declared)):
            raise KVStoreError(f"pushpull({key!r}): a declared key is summed in place in the tensor declared "
                               f"for it (declare_order); pass that tensor as ins and no other outs")
        if key in self.handles:
            raise KVStoreError(f"pushpull({key!r}): pushed again before wait covered it (a declared key "
                               f"goes once per round)")

    def submit(self, key: Key) -> None:
        self.handles[key] = self.reducer.submit(self.buckets[key])

    def wait(self, keys: list[Key] | None) -> None:
        """Wait the handles of `keys` (every pushed declared key if None), in the declared order."""
        want = [k for k in self.keys if k in self.handles and (keys is None or k in keys)]
        for k in want:
            try:
                self.reducer.wait(self.handles[k], f"the allreduce of declared key {k!r}")
            except CommError as e:  # a key declared before it was not pushed this round
                missing = [d for d in self.keys if d not in self.handles]
                raise KVStoreError(f"wait({k!r}): declared keys go in the declared order and every one each "
                                   f"round; not pushed yet: {missing[:20]} ({e})") from e
            except ReduceError as e:
                del self.handles[k]
                raise KVStoreError(f"the allreduce of declared key {k!r} failed: {e}") from e
            del self.handles[k]

    def set_codec(self, codec: Codec | None) -> None:
        """Rebuild the reducer with `codec` (the store waited for everything first)."""
        self.reducer.close()
        self.reducer, self.buckets = self._build(codec)

    def close(self) -> None:
        self.reducer.close()
        self.comm.free()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _signature(t: torch.Tensor) -> Sig:
    """What every rank must agree on for a key: shape, dtype and device type (a key on a GPU on one rank
    and on the CPU on another would fuse differently: refused by name instead)."""
    dtype = str(t.dtype) if t.is_cpu else f"{t.dtype} on {t.device.type}"
    return tuple(t.shape), dtype


def _fusion_groups(entries: list[Entry], limit: int) -> list[list[Entry]]:
    """Consecutive entries of one dtype and device whose sizes sum to at most `limit` bytes form a group; an
    entry larger than `limit` is a group of its own (and is reduced in place, without a copy)."""
    groups: list[list[Entry]] = []
    used = 0
    for e in entries:
        nbytes = e.buf.numel() * e.buf.element_size()
        head = groups[-1][0].buf if groups else None
        if head is not None and head.dtype == e.buf.dtype and head.device == e.buf.device and used + nbytes <= limit:
            groups[-1].append(e)
            used += nbytes
        else:
            groups.append([e])
            used = nbytes
    return groups


def _mismatch(key: Key, by_rank: dict[int, Sig], size: int) -> KVStoreError:
    lines = "; ".join(f"rank {r}: shape {list(s[0])} {s[1]}" for r, s in sorted(by_rank.items()))
    silent = [r for r in range(size) if r not in by_rank]
    tail = f"; ranks {silent} have not pushed it" if silent else ""
    return KVStoreError(f"dist_sync_mpi: key {key!r} was pushed with different shapes/dtypes: {lines}{tail}")


def _backoff() -> Backoff:
    """Pause between cycles that matched nothing while every rank has work queued (ranks pushing in
    different orders): 50 us doubling to 1 ms. A local push wakes the thread at once."""
    return Backoff(5e-5, 1e-3)


def _close_at_exit(ref: weakref.ReferenceType[CoordinatorStore]) -> None:
    """Close a store the program forgot to close (its comm thread is in collectives with the peers)."""
    store = ref()
    if store is not None:
        store.close()
