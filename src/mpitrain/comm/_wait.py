"""Completing one request with a way out: the comm-level face of :mod:`mpitrain._utils.stall`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from .._utils.stall import DEFAULT_POLICY, StallPolicy, poll, wait_until
from ._inflight import abandon
from .base import Communicator, Request

__all__ = ["wait_request", "wait_collective", "StallPolicy", "DEFAULT_POLICY", "NOTE_TAG"]

#: the tag of the arrival notes a late :func:`wait_collective` exchanges (apart from every other tag in use)
NOTE_TAG = 32125


def wait_request(req: Request, what: str | Callable[[], str], policy: StallPolicy = DEFAULT_POLICY,
                 who: str = "", abort: Callable[[int], None] | None = None) -> torch.Tensor | None:
    """``req.wait()`` with a way out (:func:`mpitrain._utils.stall.wait_until` polling ``req.test()``):
    every `policy.warn_after` s one line on stderr "<who>: still waiting after <N>s for <what>" (e.g.
    who="rank 0", what="recv of activation 3 of micro-batch 2 from rank 1"); after
    `policy.abort_after` s ``abort(1)``, which ends every rank (without `abort`: StallError).

    Returns what ``req.wait()`` returns (the received tensor of a receive). Only the calling rank waits;
    polls with sleeps that back off to `policy.max_nap`, so a stalled rank does not spin a core."""
    wait_until(req.test, what, policy, who=who, abort=abort)
    return req.wait()


class _Arrivals:
    """The slow path of a late collective wait: a note "I am waiting in collective `seq`" to every other rank
    of `comm` and a receive for each of theirs, so the ranks whose note has not come are named: those that
    have not started the collective, and those that started it but are held up in another wait before
    waiting for it (a pipeline stage blocked on a message; only a rank waiting here sends a note). Costs
    nothing unless a wait is late; its requests are settled (:func:`~._inflight.abandon`) when it ends."""

    def __init__(self, comm: Communicator, seq: int) -> None:
        self.comm, self.seq = comm, seq
        self.others = [r for r in range(comm.size) if r != comm.rank]
        self._note = torch.tensor([seq], dtype=torch.int64)
        self._sends = [comm.isend(self._note, r, NOTE_TAG) for r in self.others]
        self._bufs = {r: torch.zeros(1, dtype=torch.int64) for r in self.others}
        self._recvs = {r: comm.irecv(self._bufs[r], r, NOTE_TAG) for r in self.others}
        self._here: set[int] = set()

    def missing(self) -> list[int]:
        """The other ranks whose note for this collective (or a later one) has not arrived."""
        for r in self.others:
            while r not in self._here and self._recvs[r].test():
                if int(self._bufs[r]) >= self.seq:
                    self._here.add(r)
                else:  # a note of an earlier late wait that this rank did not need then: read on
                    self._recvs[r] = self.comm.irecv(self._bufs[r], r, NOTE_TAG)
        return [r for r in self.others if r not in self._here]

    def settle(self) -> None:
        abandon([*self._recvs.values(), *self._sends])


def wait_collective(req: Request, comm: Communicator, seq: int, what: str | Callable[[], str],
                    policy: StallPolicy = DEFAULT_POLICY, who: str = "",
                    abort: Callable[[int], None] | None = None) -> torch.Tensor | None:
    """``req.wait()`` of a collective on `comm` (the `seq`-th of its kind, counted alike on every rank) with
    a way out that names the ranks not there: polled with a short spin (the usual case: done at once);
    after ``warn_after / 4`` s this rank sends the others a note and receives theirs (:class:`_Arrivals`), so
    each later line -- "still waiting after Ns for <what>; ranks [..] are not waiting in it (...)" every
    `warn_after`, then "gave up ..." and ``abort(1)`` after `abort_after` (counted from the start) -- names
    the ranks whose note has not come: those that never started this collective, or are held up in another
    wait first (a rank that stopped is among them). Only the calling rank waits; a stalled rank sleeps
    between tests (backing off to 0.2 ms). The naming needs receives that can be cancelled (MPI's): under
    torch.distributed a note receive left from an earlier late wait stays pending, so a later line may name
    a rank that is there (the wait itself is unaffected)."""
    policy = dataclasses.replace(policy, spin=max(policy.spin, 5e-5), max_nap=min(policy.max_nap, 2e-4),
                                 first_nap=min(policy.first_nap, 2e-4))
    early = policy.warn_after / 4
    if poll(req.test, policy, deadline=time.monotonic() + early):
        return req.wait()
    arrivals = _Arrivals(comm, seq)

    def late() -> str:
        text = what() if callable(what) else what
        gone = arrivals.missing()
        if not gone:
            return f"{text}; every rank is waiting in it"
        return f"{text}; ranks {gone} are not waiting in it (not there yet, or held up in another wait first)"

    rest = dataclasses.replace(policy, warn_after=policy.warn_after - early,
                               abort_after=None if policy.abort_after is None else policy.abort_after - early)
    try:
        wait_until(req.test, late, rest, who=who, abort=abort)
    finally:
        arrivals.settle()
    return req.wait()
