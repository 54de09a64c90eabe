"""The engine: one background thread per process that negotiates and runs every Horovod collective.

Why a thread: Horovod's ``*_async`` calls return at once and complete later, while the caller computes
(the DistributedOptimizer overlaps gradient reductions with backward this way). Every operation is a
small :class:`Op` queued by the calling thread; the engine thread runs the queue in order:

1. **Negotiation**: one gather of the op's pickled signature over the process set's private
   communicator, as a nonblocking int64 sum-allreduce of per-rank slots (:func:`_gather_small`) that
   the thread polls with short sleeps: a rank that reaches an op before its peers waits without
   spinning a core that its own backward pass needs. The ``key`` part (kind, name, dtypes, shapes, op,
   root, ...) must be equal on every rank, else *every* rank fails the op with a
   :class:`HorovodInternalError` naming the ranks, the tensor and what differs, and goes on with the
   next op (nothing was sent, so nothing hangs and the library stays usable). The ``info`` part
   carries what may differ per rank (first dimensions of an allgather, splits of an alltoall), so
   receivers learn their counts without another message.
2. **Execution**: blocking collectives of :class:`~mpitrain.comm.base.Communicator` (MPI releases the
   GIL while they run, so the caller's thread computes meanwhile).

Ordering: ops of one process set must be issued in the same order on every rank (Horovod matches them
by name instead). A rank that called ``join()`` keeps negotiating on the global set, contributing
zeros to allreduces (see :data:`JOIN_HANDLERS`) until every rank has joined.

Negotiation waits go through :func:`~mpitrain._utils.stall.wait_until` (a warning after a minute,
the end of the job after ten); the blocking collectives that follow are
:func:`~mpitrain._utils.stall.watched`.
"""

from __future__ import annotations

import pickle
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from .._utils.stall import DEFAULT_POLICY, StallPolicy, wait_until, watched
from ..comm.base import Communicator

__all__ = ["Op", "Engine", "JOIN_HANDLERS", "Key", "HorovodInternalError"]


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank that took part: ranks disagreed on it (shape, dtype, root,
    kind), it is not allowed while a rank has joined, or the transport failed. The library stays usable."""


#: What a joined rank sends in a negotiation round.
JOIN = "__join__"
#: A signature key: (kind, name, ((field, value), ...)); equal on every rank for the op to run.
Key = tuple[str, str | None, tuple[tuple[str, Any], ...]]
#: kind -> what a joined rank does when the active ranks run an op of that kind with this key (e.g.
#: allreduce zeros). Kinds not listed fail on the active ranks while any rank has joined.
JOIN_HANDLERS: dict[str, Callable[[Communicator, Key], None]] = {}
#: How long a blocked negotiation or collective may last before a warning names it.
WARN_AFTER = DEFAULT_POLICY.warn_after
#: Negotiation waits: 50 us of back-to-back tests (peers that are already there), then sleeps growing to
#: 0.2 ms; a warning after a minute, the end of the job after ten.
NEGOTIATION_POLICY = StallPolicy(warn_after=WARN_AFTER, abort_after=DEFAULT_POLICY.abort_after, max_nap=2e-4,
                                 first_nap=1e-5, spin=5e-5)
#: int64 words per rank in a negotiation round (2 KiB); a longer signature falls back to a pickled allgather.
SLOT_WORDS = 256


def _gather_small(comm: Communicator, obj: Any, wait: Callable[[Callable[[], bool]], None]) -> list[Any]:
    """Every rank's `obj`, in rank order: each rank writes its pickle into its own slot of a zeroed
    int64 buffer and one nonblocking sum-allreduce assembles them (adding zeros is exact for any bit
    pattern); `wait(done)` waits for it. If any pickle exceeds its slot, every rank sees that length and
    all fall back to a pickled allgather together."""
    blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    cap = (SLOT_WORDS - 1) * 8
    buf = torch.zeros(comm.size, SLOT_WORDS, dtype=torch.int64)
    buf[comm.rank, 0] = len(blob)
    if len(blob) <= cap:
        padded = bytearray(blob) + bytes(-len(blob) % 8)
        if padded:
            buf[comm.rank, 1:1 + len(padded) // 8] = torch.frombuffer(padded, dtype=torch.int64)
    req = comm.iallreduce(buf, "sum")
    wait(req.test)
    lengths = buf[:, 0].tolist()
    if max(lengths) > cap:
        return comm.allgather_object(obj)
    raw = buf[:, 1:].contiguous().view(torch.uint8).numpy().tobytes()
    row = cap
    return [pickle.loads(raw[r * row:r * row + n]) for r, n in enumerate(lengths)]


class Op:
    """One queued collective. `execute(comm, infos)` runs on the engine thread after a successful
    negotiation (`infos[r]` is rank r's `info`, None for a joined rank) and returns the result."""

    def __init__(self, kind: str, name: str | None, pset_id: int, key: Key, info: Any,
                 execute: Callable[[Communicator, list[Any]], Any]) -> None:
        self.kind, self.name, self.pset_id, self.key, self.info = kind, name, pset_id, key, info
        self.execute = execute
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def describe(self) -> str:
        return f"{self.kind} {self.name!r}" if self.name else self.kind


def _describe_key(key: Key) -> str:
    kind, name, fields = key
    head = f"{kind} {name!r}" if name else kind
    return head + "".join(f", {k}={v}" for k, v in fields)


def _disagreement(op: Op, keys: list[tuple[int, Key]]) -> str | None:
    """None if every rank's key equals the first one's, else a message naming ranks and differences."""
    ref_rank, ref = keys[0]
    bad = [(r, k) for r, k in keys if k != ref]
    if not bad:
        return None
    r1, k1 = bad[0]
    if k1[:2] != ref[:2]:
        what = f"rank {ref_rank} runs {_describe_key(ref)}; rank {r1} runs {_describe_key(k1)}"
    else:
        a, b = dict(ref[2]), dict(k1[2])
        diffs = [f"{f}: rank {ref_rank} has {a.get(f)}, rank {r1} has {b.get(f)}"
                 for f in dict.fromkeys([*a, *b]) if a.get(f) != b.get(f)]
        what = "; ".join(diffs)
    return (f"{op.describe()}: ranks {[r for r, _ in bad]} disagree with rank {ref_rank} ({what}). "
            f"Every rank of the process set must issue the same collectives, in the same order, with "
            f"matching tensors")


class Engine:
    """The engine thread and the private communicators it owns (process set id -> communicator; None
    where this rank is not a member). Created collectively by ``init``; :meth:`stop` ends it."""

    def __init__(self, world: Communicator) -> None:
        self.rank = world.rank
        self._abort = world.abort
        dup = world.split(0, world.rank)
        assert dup is not None
        self.comms: dict[int, Communicator | None] = {0: dup}
        self._queue: deque[Op | None] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._round = 0                      # negotiation rounds on the global set (same on every rank)
        self._joined_at: dict[int, int] = {}  # rank -> first round it negotiated as joined
        self._thread = threading.Thread(target=self._loop, name="mpitrain-horovod-engine", daemon=True)
        self._thread.start()

    # -- calling thread -----------------------------------------------------------------------------
    def submit(self, op: Op) -> None:
        with self._cv:
            if self._stopped:
                raise ValueError("Horovod has been shut down; use hvd.init().")
            self._queue.append(op)
            self._cv.notify()

    def stop(self) -> None:
        """Finish the queued ops, free the private communicators and end the thread."""
        with self._cv:
            if self._stopped:
                return
            self._stopped = True
            self._queue.append(None)
            self._cv.notify()
        wait_until(lambda: not self._thread.is_alive(), "the Horovod engine to finish its queued operations",
                   who=f"rank {self.rank}", abort=self._abort)

    # -- engine thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue))
                op = self._queue.popleft()
            if op is None:
                break
            try:
                op.result = self._run(op)
            except BaseException as e:  # noqa: BLE001 - handed to the thread that synchronizes
                op.error = e
            op.done.set()
        for comm in self.comms.values():
            if comm is not None:
                comm.free()
        self.comms.clear()

    def _negotiate(self, comm: Communicator, pset_id: int, mine: Any, what: str) -> list[Any]:
        def wait(done: Callable[[], bool]) -> None:
            wait_until(done, f"every rank of the process set to issue {what}", NEGOTIATION_POLICY,
                       who=f"rank {self.rank} (horovod engine)", abort=self._abort)

        sigs = _gather_small(comm, mine, wait)
        if pset_id == 0:
            self._round += 1
            for r, s in enumerate(sigs):
                if s == JOIN:
                    self._joined_at.setdefault(r, self._round)
        return sigs

    def _run(self, op: Op) -> Any:
        comm = self.comms.get(op.pset_id)
        if comm is None:
            raise HorovodInternalError(f"{op.describe()}: process set {op.pset_id} does not exist (removed?) "
                                       f"or does not include rank {self.rank}")
        if op.kind == "join":
            return self._join(comm)
        sigs = self._negotiate(comm, op.pset_id, (op.key, op.info), op.describe())
        joined = [r for r, s in enumerate(sigs) if s == JOIN]
        keys = [(r, s[0]) for r, s in enumerate(sigs) if s != JOIN]
        problem = _disagreement(op, keys)
        if problem:
            raise HorovodInternalError(problem)
        if joined and op.kind not in JOIN_HANDLERS:
            raise HorovodInternalError(f"{op.describe()}: rank(s) {joined} have called join(); only allreduce "
                                       f"and barrier can run until every rank has joined")
        # no_grad: in-place work on the caller's tensors (leaves that require grad included) is not autograd's
        with watched(f"rank {self.rank}: horovod {op.kind}", f"{op.describe()} in progress", WARN_AFTER), \
                torch.no_grad():
            return op.execute(comm, [None if s == JOIN else s[1] for s in sigs])

    def _join(self, comm: Communicator) -> int:
        """Negotiate as joined until every rank has joined; meanwhile take part in the others' allreduces
        (zeros) and barriers. Returns the last rank to join (ties: the highest rank), the same everywhere."""
        while True:
            sigs = self._negotiate(comm, 0, JOIN, "join")
            active = [s[0] for s in sigs if s != JOIN]
            if not active:
                last = max(self._joined_at, key=lambda r: (self._joined_at[r], r))
                self._joined_at.clear()
                return last
            if all(k == active[0] for k in active) and active[0][0] in JOIN_HANDLERS:
                with watched(f"rank {self.rank}: horovod join", f"joined rank in {active[0][0]}", WARN_AFTER), \
                        torch.no_grad():
                    JOIN_HANDLERS[active[0][0]](comm, active[0])
