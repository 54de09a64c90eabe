"""The gradient reducer: buckets of tensors summed (or averaged) over a communicator in one fixed order.

Every strategy that averages gradients hands its buckets to a :class:`Reducer` (issue #29 item 1):
pipeline (``strategies/_grad_allreduce``), spatial (``spatial/_reduce.GradBucket``), Pipe-SGD
(``strategies/pipesgd.CommThread``), ZeRO (``strategies/_zero``, through the ordered ops below), the
collective kvstore types' reductions and Horovod's allreduces.

A bucket is a list of tensors of one dtype and device, reduced as ONE flat buffer: the tensors' own
memory when they already lie back to back (``_utils/flat.joined``: views of one gradient buffer, or one
tensor alone; no copy), else a flat copy made at submit and copied back when it completes.

Order: buckets are registered (:meth:`Reducer.register`) in a fixed order that must be the same on every
rank; each round every bucket is submitted once, in any order, and the reducer posts them in registration
order (a bucket submitted early is held until the ones registered before it are submitted). So ranks may
finish their buckets in different orders and still issue identical collectives, with no negotiation.

Ordered ops: :meth:`Reducer.post_allreduce`, :meth:`Reducer.post_reduce_scatter` and
:meth:`Reducer.post_allgather` take buffers that are not registered (ZeRO's transient reduce buffers, its
parameter blocks) and are posted the moment they are called, in call order (FIFO), on the same thread and
in the same queue as the buckets. Their order on the wire is the caller's: every rank must call them in
the same order. How both kinds coexist: a round is *open* from its first bucket's submission until its last
bucket is posted, and while it is open the place an ordered op would take among the round's buckets would
depend on each rank's submission order, so an ordered op is refused then (CommError, local, before any
message). Between rounds they mix freely: the collectives on `comm` are the rounds and the ordered ops in the
order the program reaches them, the same on every rank. The policy applies to allreduces (buckets and
:meth:`~Reducer.post_allreduce`); reduce-scatters and allgathers are the communicator's own.

Who posts: with ``thread=False`` the caller does, at submit (a flat policy posts a nonblocking allreduce
and returns at once: several buckets are in flight in MPI; a ring or the hierarchy runs to completion
inside submit, an ordered op inside its post);
with ``thread=True`` ONE worker thread per reducer runs the collectives in order (blocking ones, which
release the GIL: the caller computes meanwhile). Every wait has the stall policy's way out: a request is
waited blocking inside MPI under :func:`~mpitrain._utils.stall.watched` (warning after ``warn_after``,
ending the job after ``abort_after``); a worker's result is waited with
:func:`~mpitrain._utils.stall.wait_until`. A failure on the worker is raised by the wait of the bucket or op
it failed, and of every later one (:class:`ReduceError`, the original as its cause). Device buffers are
produced on the caller's stream: each bucket or op records a ready event there when submitted or posted
(``comm/_cuda.ready_event``) and its collective runs on the device's side stream after it (``after``).

Policies (:class:`ReducePolicy`):

- ``"flat"``: one allreduce per bucket, the backend's (the MPI backend takes its host hierarchy,
  ``comm/_hierarchical.py``, for buckets of at least 256 KiB when the ranks span hosts: chosen by size
  and hosts, the same verdict on every rank).
- ``"hierarchical"``: every bucket through the host hierarchy, whatever its size (MPI backend only;
  :meth:`~mpitrain.comm._mpi.MPICommunicator.hierarchical_allreduce`, the same code the flat policy's large
  buckets take): a reduce onto one leader per host, the leaders' allreduce across hosts, a broadcast from
  each leader. On one host it is the first and last stage alone (reduce onto the host's leader, broadcast
  back): correct, the same result on every rank, no network stage. Integers and integer-valued floats give
  a plain allreduce's result to the bit; other floats agree within rounding (the sum's order differs:
  per host first, then across hosts). A device bucket goes through a pinned host mirror.
- ``"ring"``: :func:`mpitrain.comm.ring.ring_allreduce` without a codec (exact, bitwise the same on every
  rank, the sum in ring order), floating buckets only; a device bucket goes through a pinned host mirror.
- ``"compressed"``: the same ring with a codec at every hop (:mod:`mpitrain.comm.codecs`), optionally with
  error feedback: a residual per feedback group (by default per bucket) carries each reduction's
  compression error into the next reduction of that group.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .._utils.flat import copy_from_flat, flatten, joined
from .._utils.stall import DEFAULT_POLICY, StallPolicy, wait_until, watched
from ._cuda import after, ready_event
from ._layer import backend_of
from ._staging import Staging
from .base import CommError, Communicator, Request
from .codecs import Codec, get_codec
from .ring import DEFAULT_CHUNK_BYTES, ring_allreduce

if TYPE_CHECKING:
    from ._mpi import MPICommunicator

__all__ = ["Reducer", "ReducePolicy", "Bucket", "Handle", "OpHandle", "ReduceError", "POLICIES", "OPS"]

#: The reducing policies, by name (see the module docstring).
POLICIES = ("flat", "ring", "compressed", "hierarchical")


#: The ordered ops (see "Ordered ops" in the module docstring).
OPS = ("allreduce", "reduce_scatter", "allgather")


class ReduceError(RuntimeError):
    """A reduction failed on the worker thread; raised by :meth:`Reducer.wait` with the original as cause."""


@dataclass(frozen=True)
class ReducePolicy:
    """How a bucket is reduced: `kind` (one of :data:`POLICIES`), `op` ("sum" or "avg"), and for the
    rings the chunk size; for "compressed" the `codec` (a name of :mod:`mpitrain.comm.codecs` or a Codec)
    and `error_feedback`. Checked at construction (CommError), before any message."""

    kind: str = "flat"
    op: str = "avg"
    codec: str | Codec | None = None
    error_feedback: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise CommError(f"reducer: unknown policy {self.kind!r}; choose one of {POLICIES}")
        if self.op not in ("sum", "avg"):
            raise CommError(f"reducer: op must be 'sum' or 'avg', got {self.op!r}")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1:
            raise CommError(f"reducer: chunk_bytes must be a positive int, got {self.chunk_bytes!r}")
        codec = get_codec(self.codec)  # raises CommError for an unknown name
        if self.kind != "compressed" and (codec.name is not None or self.error_feedback):
            raise CommError(f"reducer: a codec and error feedback belong to policy 'compressed', not {self.kind!r}")

    @property
    def ring(self) -> bool:
        """Whether buckets go through :func:`~mpitrain.comm.ring.ring_allreduce` ("ring", "compressed")."""
        return self.kind in ("ring", "compressed")

    @property
    def codec_obj(self) -> Codec:
        return get_codec(self.codec)


@dataclass(eq=False)
class Bucket:
    """A registered bucket: its tensors, its place in the order, the buffer it is reduced in."""

    index: int
    tensors: list[torch.Tensor]
    flat: torch.Tensor  # the tensors' own memory (in_place) or a flat copy of them
    in_place: bool
    feedback: Hashable  # the error-feedback group of its residual

    @property
    def numel(self) -> int:
        return self.flat.numel()


@dataclass(eq=False)
class Handle:
    """One submitted bucket; :meth:`Reducer.wait` completes it (idempotent)."""

    bucket: Bucket
    done: threading.Event = field(default_factory=threading.Event)
    request: Request | None = None  # a flat bucket posted by the caller
    error: BaseException | None = None
    ready: Any = None  # a device bucket: the event after which the caller's stream has produced it
    finished: bool = False  # copied back (where not in place)


@dataclass(eq=False)
class OpHandle:
    """One ordered op (:meth:`Reducer.post_allreduce`, :meth:`~Reducer.post_reduce_scatter`,
    :meth:`~Reducer.post_allgather`); :meth:`Reducer.wait` completes it (idempotent). `result`: the
    reduced tensor (allreduce: `tensor` itself; reduce-scatter: this rank's block; allgather: `out`).
    A reduce-scatter drops its input rows once it has run, so they are freed then, not at the wait."""

    kind: str  # one of OPS
    tensor: torch.Tensor | None  # allreduce: reduced in place; reduce_scatter: the rows; allgather: the block
    out: torch.Tensor | None  # allgather: the whole buffer written in place
    what: str  # names it in a stall warning and a ReduceError
    feedback: Hashable = None  # an allreduce's error-feedback group
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    ready: Any = None  # a device op: the event after which the caller's stream has produced its input
    stream: Any = None  # a device op: the caller's stream, which will read a reduce-scatter's new result
    result: torch.Tensor | None = None
    finished: bool = False


class Reducer:
    """Reduces registered buckets over `comm` in registration order with `policy` (see the module docstring).

    `comm` must be used by nobody else for collectives while buckets are in flight, unless every rank
    interleaves its own calls identically (pass a ``split(0)`` duplicate to a reducer with a thread).
    Every rank of `comm` must register the same buckets (sizes, dtypes) in the same order and submit
    each of them once per round. `stats` (optional) accumulates ``codec_s`` (ring codecs) and ``comm_s``
    (seconds inside the collectives on the thread that ran them). `around(bucket)` (a context manager)
    wraps, and `after_reduce(bucket)` follows, each registered bucket's reduction where it runs (not the
    ordered ops'). Policy "hierarchical" needs the MPI backend under `comm`'s layers (CommError otherwise,
    at construction, before any message)."""

    def __init__(self, comm: Communicator, policy: ReducePolicy | None = None, stall: StallPolicy = DEFAULT_POLICY,
                 *, thread: bool = False, name: str = "reducer", stats: dict[str, float] | None = None,
                 around: Callable[[Bucket], AbstractContextManager[Any]] | None = None,
                 after_reduce: Callable[[Bucket], None] | None = None) -> None:
        self.comm, self.policy, self.stall, self.name = comm, policy or ReducePolicy(), stall, name
        self.stats = stats if stats is not None else {}
        self.buckets: list[Bucket] = []
        #: error-feedback residuals by feedback group (compressed with error feedback only); callers may
        #: save and restore them (checkpoints)
        self.residuals: dict[Hashable, torch.Tensor | None] = {}
        # what a user wraps each bucket's reduction in (a timeline span: comm cannot import the timeline),
        # and runs after it (Pipe-SGD's link emulation), both on the thread that reduces
        self._around, self._after_reduce = around, after_reduce
        self._held: dict[int, Handle] = {}  # submitted, waiting for an earlier bucket of the round
        self._next = 0  # registration index of the next bucket to post
        self._inflight: list[Handle | OpHandle] = []  # posted, not yet waited
        self._codec = self.policy.codec_obj
        self._staging: Staging | None = None  # device buckets of the rings: host mirrors (made on first use)
        self._thread = thread
        self._queue: queue.Queue[Handle | OpHandle | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        # refused here, on every rank alike, not at the first bucket; found once, not per bucket
        self._hierarchy = _hierarchy_backend(comm, name) if self.policy.kind == "hierarchical" else None

    # -- registration and submission ---------------------------------------------------------------
    def register(self, tensors: Sequence[torch.Tensor], *, feedback: Hashable = None) -> Bucket:
        """Add a bucket at the end of the order (every rank registers the same buckets in the same order).
        Local checks only (CommError): one dtype and device, floating for the rings, the codec's input.
        `feedback`: the error-feedback group (default: the bucket's own); buckets of one group share one
        residual, so they must have the same numel."""
        ts = list(tensors)
        if not ts:
            raise CommError(f"{self.name}: a bucket needs at least one tensor")
        first = ts[0]
        if any(t.dtype != first.dtype or t.device != first.device for t in ts):
            raise CommError(f"{self.name}: a bucket holds one dtype on one device, got "
                            f"{sorted({f'{t.dtype}/{t.device}' for t in ts})}")
        if self.policy.ring:
            self._check_ring_input(first)
        span = joined(ts)
        flat = span if span is not None else torch.empty(sum(t.numel() for t in ts), dtype=first.dtype,
                                                          device=first.device)
        group = len(self.buckets) if feedback is None else feedback
        bucket = Bucket(len(self.buckets), ts, flat, span is not None, group)
        if self.policy.error_feedback:
            other = next((b for b in self.buckets if b.feedback == group), None)
            if other is not None and other.numel != bucket.numel:
                raise CommError(f"{self.name}: feedback group {group!r} mixes buckets of {other.numel} and "
                                f"{bucket.numel} elements")
            self.residuals.setdefault(group, None)
        self.buckets.append(bucket)
        return bucket

    def submit(self, bucket: Bucket) -> Handle:
        """Hand `bucket` over for reduction; its tensors must not be touched until :meth:`wait`.

        Posted at once when it is the next in registration order (then any held buckets that follow),
        else held. Submitting a bucket twice in one round raises CommError (local), as does a flat bucket
        the communicator refuses when the caller posts it. Never raises for a failure of an earlier bucket
        on the worker: that surfaces in :meth:`wait`."""
        if bucket.index in self._held or bucket not in self.buckets[bucket.index:bucket.index + 1]:
            raise CommError(f"{self.name}: bucket {bucket.index} submitted twice in one round, or not registered here")
        if not bucket.in_place:
            flatten(bucket.tensors, out=bucket.flat)
        handle = Handle(bucket, ready=None if bucket.flat.is_cpu else ready_event(bucket.flat))
        self._held[bucket.index] = handle
        while self._due in self._held:
            due = self._due
            self._post(self._held.pop(due))
            self._next = due + 1
        return handle

    def _check_ring_input(self, t: torch.Tensor) -> None:
        if not t.is_floating_point():
            raise CommError(f"{self.name}: policy {self.policy.kind!r} reduces floating tensors, got {t.dtype}")
        self._codec.check_input(t.detach()[:0].reshape(-1), "bucket")

    @property
    def _due(self) -> int:
        """The index of the bucket to post next: a round ends after the last registered bucket (so one
        registered after its round's others were posted, before the next round starts, joins that round)."""
        return self._next if self._next < len(self.buckets) else 0

    def reduce(self, tensors: Sequence[torch.Tensor], *, feedback: Hashable = "unregistered") -> None:
        """Blocking form for one bucket that is not registered: reduce `tensors` as one bucket on the
        calling thread and return with the results in them. Every rank must call it at the same point of
        its collectives on `comm`; not while registered buckets are held or queued for a worker. With
        error feedback, `feedback` names the residual's group (its buckets must have one numel)."""
        if self._held or (self._thread and self._inflight):
            raise CommError(f"{self.name}: reduce() while registered buckets are in flight would reorder them")
        ts = list(tensors)
        span = joined(ts)
        flat = span if span is not None else flatten(ts)
        self._allreduce(flat, feedback, lambda: f"a blocking allreduce of {flat.numel()} elements")
        if span is None:
            copy_from_flat(flat, ts)

    # -- ordered ops ---------------------------------------------------------------------------------
    def post_allreduce(self, flat: torch.Tensor, *, feedback: Hashable = "unregistered",
                       what: str | None = None) -> OpHandle:
        """Post the allreduce of `flat` (contiguous) in place with the policy, in call order (module docstring,
        "Ordered ops"). Do not touch `flat` until :meth:`wait`. `feedback`: the residual's group (compressed
        with error feedback). CommError (local) while a round of registered buckets is open."""
        self._check_op(flat, "post_allreduce")
        if self.policy.ring:
            self._check_ring_input(flat)
        return self._post_op(OpHandle("allreduce", flat, None, what or f"an allreduce of {flat.numel()} elements",
                                      feedback=feedback))

    def post_reduce_scatter(self, rows: torch.Tensor, *, what: str | None = None) -> OpHandle:
        """Post the reduce-scatter (the policy's op) of `rows` (contiguous, ``size`` rows along dim 0): the
        handle's `result` is this rank's row of the reduction. The reducer lets go of `rows` once the
        collective has run (a transient buffer is freed then). Call order; CommError while a round is open."""
        self._check_op(rows, "post_reduce_scatter")
        if rows.dim() == 0 or rows.shape[0] != self.comm.size:
            raise CommError(f"{self.name}: post_reduce_scatter needs {self.comm.size} rows along dim 0, "
                            f"got shape {tuple(rows.shape)}")
        return self._post_op(OpHandle("reduce_scatter", rows, None,
                                      what or f"a reduce-scatter of {rows.numel()} elements"))

    def post_allgather(self, block: torch.Tensor, out: torch.Tensor, *, what: str | None = None) -> OpHandle:
        """Post the allgather of every rank's `block` into `out` (in place where `block` is this rank's block
        of `out`), in call order; CommError while a round is open."""
        self._check_op(block, "post_allgather")
        self._check_op(out, "post_allgather")
        if out.numel() != block.numel() * self.comm.size or out.dtype != block.dtype:
            raise CommError(f"{self.name}: post_allgather of {block.numel()} x {block.dtype} needs an out of "
                            f"{block.numel() * self.comm.size} x {block.dtype}, got {out.numel()} x {out.dtype}")
        return self._post_op(OpHandle("allgather", block, out, what or f"an allgather of {out.numel()} elements"))

    @property
    def round_open(self) -> bool:
        """Whether a round of registered buckets has begun and not all of its buckets are posted yet."""
        return bool(self._held) or 0 < self._next < len(self.buckets)

    def _check_op(self, t: torch.Tensor, what: str) -> None:
        if self.round_open:
            raise CommError(f"{self.name}: {what} while a round of registered buckets is open (bucket {self._due} "
                            "not submitted yet) would take a different place among them on each rank")
        if not t.is_contiguous():
            raise CommError(f"{self.name}: {what} needs contiguous tensors, got strides {t.stride()}")

    def _post_op(self, handle: OpHandle) -> OpHandle:
        assert handle.tensor is not None
        if not handle.tensor.is_cpu:
            handle.ready = ready_event(handle.tensor)
            handle.stream = torch.cuda.current_stream(handle.tensor.device)
        self._inflight.append(handle)
        if self._thread:
            self._start_worker()
            self._queue.put(handle)
        else:
            self._execute(handle)
        return handle

    # -- completion ----------------------------------------------------------------------------------
    def wait(self, handle: Handle | OpHandle, what: str | None = None) -> None:
        """Block until `handle`'s bucket is reduced and its tensors hold the result, or its ordered op is
        done (idempotent). Raises ReduceError where the worker failed it; a stall warns ("<name> rank R:
        still waiting after Ns for <what>", by default naming the bucket or op) and ends the job as the
        policy says."""
        if handle.finished:
            return
        request = None
        if isinstance(handle, OpHandle):
            what = what or handle.what
        else:
            if self._held.get(handle.bucket.index) is handle:
                raise CommError(f"{self.name}: bucket {handle.bucket.index} waits for bucket {self._due} to be "
                                "submitted first (registration order)")
            what = what or f"the reduction of bucket {handle.bucket.index} ({handle.bucket.numel} elements)"
            request = handle.request
        if request is not None:
            if not request.test():
                with self._watched(what):
                    request.wait()
            handle.done.set()
        else:
            nap = min(1.0, self.stall.warn_after / 4)  # blocks on the Event: woken as soon as it is set
            wait_until(lambda: handle.done.wait(nap), what, self.stall, who=f"{self.name} rank {self.comm.rank}",
                       abort=self.comm.abort)
        if handle in self._inflight:
            self._inflight.remove(handle)
        if handle.error is not None:
            raise ReduceError(f"{what} failed on rank {self.comm.rank}: {handle.error!r}") from handle.error
        if isinstance(handle, Handle) and request is not None and not handle.bucket.in_place:
            copy_from_flat(handle.bucket.flat, handle.bucket.tensors)
        handle.finished = True

    def _watched(self, what: str | Callable[[], str]) -> AbstractContextManager[None]:
        """A blocking collective or wait on this thread under the stall policy, `what` naming it."""
        return watched(self.name, what, self.stall.warn_after, self.stall.abort_after, self.comm.abort)

    def wait_all(self) -> None:
        """Complete every posted bucket and ordered op, in order (buckets still held are an error: a round
        was left open)."""
        if self._held:
            raise CommError(f"{self.name}: buckets {sorted(self._held)} are held for bucket {self._due}, "
                            "which was never submitted")
        for handle in list(self._inflight):
            self.wait(handle)

    def close(self) -> None:
        """Finish every queued reduction and stop the worker (idempotent; collective where buckets are
        still queued: their reductions run). Frees nothing: the caller owns `comm`."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None

    @property
    def failed(self) -> bool:
        return self._error is not None

    # -- posting -------------------------------------------------------------------------------------
    def _post(self, handle: Handle) -> None:
        self._inflight.append(handle)
        if self._thread:
            self._start_worker()
            self._queue.put(handle)
        elif self.policy.kind == "flat":
            try:
                handle.request = self.comm.iallreduce(handle.bucket.flat, self.policy.op)
            except BaseException:  # refused before any message (the caller's thread): raised at submit
                self._inflight.remove(handle)
                raise
        else:
            self._execute(handle)

    def _start_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name=f"mpitrain-{self.name}", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while (handle := self._queue.get()) is not None:
            self._execute(handle)
        # (`handle` of the last op stays referenced here until the next one: ops let go of their inputs)

    def _execute(self, handle: Handle | OpHandle) -> None:
        """Run a bucket's reduction or an ordered op on this thread (the worker, or the caller without one)
        and mark `handle` done. Refused after an earlier failure; a failure is kept on `handle` (and as the
        reducer's first) for the waiting thread to re-raise."""
        try:
            if self._error is not None:
                raise ReduceError("an earlier reduction failed") from self._error
            if isinstance(handle, OpHandle):
                self._run_op(handle)
            else:
                self._reduce_bucket(handle)
        except BaseException as e:  # handed to the waiting thread, which re-raises it
            self._error = self._error or e
            handle.error = e
        finally:
            if isinstance(handle, OpHandle) and handle.kind == "reduce_scatter":
                handle.tensor = None  # the rows are freed now (ZeRO: at most one reduce buffer in flight)
            handle.done.set()

    def _run_op(self, handle: OpHandle) -> None:
        t = handle.tensor
        assert t is not None
        with after(t, handle.ready), self._timed():
            if handle.kind == "allreduce":
                self._allreduce(t, handle.feedback, lambda: handle.what)
                handle.result = t
                return
            with self._watched(handle.what):
                if handle.kind == "reduce_scatter":
                    handle.result = self.comm.reduce_scatter(t, self.policy.op)[0]
                    if handle.stream is not None:  # made on the side stream, used on the caller's:
                        handle.result.record_stream(handle.stream)  # its memory waits for that too
                else:
                    handle.result = self.comm.allgather(t, out=handle.out)

    def _reduce_bucket(self, handle: Handle) -> None:
        bucket = handle.bucket
        with (self._around(bucket) if self._around else nullcontext()), after(bucket.flat, handle.ready):
            with self._timed():
                self._allreduce(bucket.flat, feedback=bucket.feedback,
                                what=lambda: f"the allreduce of bucket {bucket.index}")
            if not bucket.in_place:
                copy_from_flat(bucket.flat, bucket.tensors)
            if self._after_reduce is not None:
                self._after_reduce(bucket)

    @contextmanager
    def _timed(self) -> Iterator[None]:
        """Adds the seconds of the collective it wraps to ``stats["comm_s"]``."""
        t0 = time.perf_counter()
        yield
        self.stats["comm_s"] = self.stats.get("comm_s", 0.0) + time.perf_counter() - t0

    def _allreduce(self, flat: torch.Tensor, feedback: Hashable, what: Callable[[], str]) -> None:
        """Reduce `flat` in place on this thread with the policy: the rings (with `feedback`'s residual),
        or one blocking allreduce watched under the stall policy (`what` names it in the warning)."""
        if self.policy.ring:
            self._ring(flat, feedback)
            return
        if self._hierarchy is not None:
            self._hierarchical(flat, what)
            return
        with self._watched(what):
            self.comm.allreduce(flat, self.policy.op)

    def _ring(self, flat: torch.Tensor, feedback: Hashable) -> None:
        """The ring policies on `flat` (a device buffer through a host mirror), with the group's residual."""
        with self._on_host(flat) as host:
            residual = None
            if self.policy.error_feedback:
                residual = self.residuals.get(feedback)
                if residual is None:
                    residual = self.residuals[feedback] = torch.zeros_like(host)
            ring_allreduce(self.comm, host, self._codec, self.policy.op, self.policy.chunk_bytes, residual,
                           self.stall.warn_after, stats=self.stats)

    def _hierarchical(self, flat: torch.Tensor, what: Callable[[], str]) -> None:
        """Policy "hierarchical": the backend's host hierarchy on `flat` whatever its size (a device buffer
        through a host mirror: the hierarchy's stages work on host memory)."""
        assert self._hierarchy is not None
        with self._on_host(flat) as host, self._watched(what):
            self._hierarchy.hierarchical_allreduce(host, self.policy.op)

    @contextmanager
    def _on_host(self, flat: torch.Tensor) -> Iterator[torch.Tensor]:
        if flat.is_cpu:
            yield flat
            return
        if self._staging is None:
            self._staging = Staging()
        host = self._staging.to_host(flat)
        yield host
        self._staging.back(flat, host)


def _hierarchy_backend(comm: Communicator, name: str) -> MPICommunicator:
    """The MPI backend under `comm`'s layers, which holds the host hierarchy (CommError for another backend)."""
    backend = backend_of(comm)
    if backend.backend != "mpi":
        raise CommError(f"{name}: policy 'hierarchical' is the MPI backend's host hierarchy; this communicator's "
                        f"backend is {backend.backend!r} (use 'flat')")
    # imported here, not at the top: importing the MPI backend initialises MPI, which a torch-backend job
    # of this module must not pay; here the backend is already MPI's
    from ._mpi import MPICommunicator

    assert isinstance(backend, MPICommunicator)
    return backend
