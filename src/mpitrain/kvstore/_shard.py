"""The dist_sync server loop: per-key shards merged in synchronous rounds, optional optimizer step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .._utils.stall import Backoff
from ..comm.base import Communicator, Request
from . import _protocol as proto
from ._interface import log
from ._protocol import Header

__all__ = ["ServerLoop"]


@dataclass
class _Shard:
    """One server's block of one key. Round r is merged once every worker pushed its r-th value."""

    store: torch.Tensor
    merge: torch.Tensor
    pushes: list[int]  # pushes received per worker
    version: int = 0  # rounds applied
    received: int = 0  # pushes merged into the current round
    early: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (round, value) ahead of time
    pulls: list[tuple[int, int]] = field(default_factory=list)  # (worker, round it must see)
    replies: list[Request] = field(default_factory=list)  # isends still reading `store`
    opt: Any = None


class ServerLoop:
    """Serves the workers' headers (one posted receive per worker, polled with backoff: no spinning)
    until every worker sent CLOSE."""

    def __init__(self, comm: Communicator, nworkers: int, warn_after: float) -> None:
        self._comm, self._nworkers, self._warn_after = comm, nworkers, warn_after
        self._shards: dict[int, _Shard] = {}
        self._factory: Any = None
        self._open = set(range(nworkers))
        self._hdr = {w: Header.empty() for w in self._open}
        self._req = {w: comm.irecv(self._hdr[w], w, proto.HDR) for w in self._open}

    def run(self) -> None:
        """Idle is legitimate (the workers compute between rounds): it warns every `warn_after` seconds
        and never aborts; the workers' own waits end the job if a server is gone."""
        nap, idle_since = Backoff(), time.monotonic()
        while self._open:
            progressed = False
            for w in sorted(self._open):
                if self._req[w].test():
                    self._handle(w, Header.unpack(self._hdr[w]))
                    if w in self._open:
                        self._req[w] = self._comm.irecv(self._hdr[w], w, proto.HDR)
                    progressed = True
            if progressed:
                nap.reset()
                idle_since = time.monotonic()
            else:
                nap.sleep()
                if time.monotonic() - idle_since > self._warn_after:
                    idle_since = time.monotonic()
                    log.warning("dist_sync server rank %d: idle for %.0fs, workers %s still open",
                                self._comm.rank, self._warn_after, sorted(self._open))
        for sh in self._shards.values():
            Request.wait_all(sh.replies)

    def _handle(self, w: int, hdr: Header) -> None:
        if hdr.op == proto.PUSH:
            assert hdr.dtype is not None
            self._push(w, self._shards[hdr.index], hdr.count, hdr.dtype)
        elif hdr.op == proto.PULL:
            sh = self._shards[hdr.index]
            sh.pulls.append((w, sh.pushes[w]))
            self._serve_pulls(sh)
        elif hdr.op == proto.INIT:
            store = self._comm.recv(torch.empty(hdr.count, dtype=hdr.dtype), w, proto.DATA)
            self._shards[hdr.index] = _Shard(store, torch.empty_like(store), [0] * self._nworkers)
            self._comm.send(torch.ones(1, dtype=torch.int64), w, proto.REPLY)
        elif hdr.op == proto.CLOSE:
            self._open.discard(w)
        elif hdr.op in proto.CONTROL:
            request = self._comm.recv_object(w, proto.OBJ)
            self._comm.send_object(self._control(hdr.op, request), w, proto.OBJ)
        else:
            raise RuntimeError(f"dist_sync server: unknown op {hdr.op} from worker {w}")

    def _push(self, w: int, sh: _Shard, count: int, dtype: torch.dtype) -> None:
        sh.pushes[w] += 1
        rnd = sh.pushes[w]
        if rnd == sh.version + 1 and sh.received == 0:
            self._comm.recv(sh.merge, w, proto.DATA)  # first value of the round lands in place
            sh.received = 1
        else:
            value = self._comm.recv(torch.empty(count, dtype=dtype), w, proto.DATA)
            if rnd == sh.version + 1:
                sh.merge.add_(value)
                sh.received += 1
            else:
                sh.early.append((rnd, value))
        while sh.received == self._nworkers:
            self._apply(sh)

    def _apply(self, sh: _Shard) -> None:
        """Close the round: store = sum, or one optimizer step with it; then take early values."""
        self._wait_replies(sh)  # pulls of the previous round still read `store`
        if self._factory is None:
            sh.store.copy_(sh.merge)
        else:
            if sh.opt is None:
                sh.opt = self._factory([sh.store])
            sh.store.grad = sh.merge
            sh.opt.step()
            sh.store.grad = None
        sh.version += 1
        sh.received = 0
        nxt = [v for r, v in sh.early if r == sh.version + 1]
        sh.early = [(r, v) for r, v in sh.early if r != sh.version + 1]
        for i, v in enumerate(nxt):
            sh.merge.copy_(v) if i == 0 else sh.merge.add_(v)
        sh.received = len(nxt)
        self._serve_pulls(sh)

    def _serve_pulls(self, sh: _Shard) -> None:
        ready = [w for w, need in sh.pulls if need <= sh.version]
        sh.pulls = [(w, need) for w, need in sh.pulls if need > sh.version]
        for w in ready:
            sh.replies.append(self._comm.isend(sh.store, w, proto.REPLY))

    def _wait_replies(self, sh: _Shard) -> None:
        Request.wait_all(sh.replies)
        sh.replies.clear()

    def _control(self, op: int, request: Any) -> Any:
        """A control op's reply object (SETOPT and LOAD: None; SAVE: the shards' optimizer states)."""
        if op == proto.SETOPT:
            spec = request
            if isinstance(spec, tuple):
                cls, defaults = spec
                self._factory = lambda params: cls(params, **defaults)
            else:
                self._factory = spec
            for sh in self._shards.values():
                sh.opt = None
            return None
        if op == proto.SAVE:
            return {i: sh.opt.state_dict() for i, sh in self._shards.items() if sh.opt is not None}
        if op == proto.LOAD:
            for i, state in request.items():
                sh = self._shards[i]
                if sh.opt is None:
                    sh.opt = self._factory([sh.store])
                sh.opt.load_state_dict(state)
            return None
        raise RuntimeError(f"dist_sync server: unknown control op {op}")
