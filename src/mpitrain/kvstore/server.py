"""The `dist_sync` KVStore: a parameter-server baseline (the last S ranks serve shards of the keys).

Workers push values to the servers and pull the merged result back, as MXNet's ``dist_sync`` does;
it exists so the comparisons of the MPI-allreduce proposal and Pipe-SGD can be reproduced. A key of
at least `bigarray_bound` elements is split over all servers (contiguous blocks of the flattened
value, by :func:`split_sizes`); a smaller key lives whole on server ``init_index % S``. Servers run
:meth:`ServerStore.serve` until every worker has closed. Messages are a 4-int64 header then the raw
shard (no pickling on the data path); each worker's messages are matched in order by MPI.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch

from .._utils.stall import wait_until
from ..comm.base import DTYPES, Communicator, Request, split_sizes
from .base import Entry, Key, KeyInfo, KVStore, KVStoreError, make_optimizer_factory, pairs, tensors

__all__ = ["ServerStore"]

_INIT, _PUSH, _PULL, _SETOPT, _SAVE, _LOAD, _CLOSE = range(7)
_HDR, _DATA, _REPLY = 11, 12, 13


class ServerStore(KVStore):
    """Ordering: no collectives on the data path; per-key rounds on each server make the result of a
    pull the merge of every worker's push of the same round (synchronous SGD). ``push`` returns at
    once; ``pull`` returns complete. With ``set_optimizer`` the update runs on the servers, and
    ``pushpull`` (a plain sum) is refused: use push then pull."""

    type = "dist_sync"

    def __init__(self, comm: Communicator, num_servers: int = 1, bigarray_bound: int = 1_000_000,
                 warn_after: float = 60.0, abort_after: float | None = 600.0) -> None:
        if not 1 <= num_servers < comm.size:
            raise KVStoreError(f"dist_sync needs 1 <= num_servers < world size ({comm.size}), "
                               f"got {num_servers}")
        self._nservers = num_servers
        self._nworkers = comm.size - num_servers
        self._server_ranks = list(range(self._nworkers, comm.size))
        self.is_server = comm.rank >= self._nworkers
        ctl = comm.split(int(self.is_server), comm.rank)
        super().__init__(comm, warn_after, abort_after, ctl=ctl)
        self._net = comm.split(0, comm.rank)
        self._bound = bigarray_bound
        self._inflight: dict[Key, list[Request]] = {}
        self._keep: dict[Key, list[torch.Tensor]] = {}

    @property
    def num_servers(self) -> int:
        return self._nservers

    # -- placement -------------------------------------------------------------------------------
    def _shards(self, info: KeyInfo) -> list[tuple[int, int, int]]:
        """(server rank, start, stop) blocks of the flattened key."""
        n = info.store.numel()
        if n < self._bound or self._nservers == 1:
            return [(self._server_ranks[info.index % self._nservers], 0, n)]
        out, lo = [], 0
        for s, size in zip(self._server_ranks, split_sizes(n, self._nservers)):
            if size:
                out.append((s, lo, lo + size))
            lo += size
        return out

    def _send(self, op: int, idx: int, dest: int, data: torch.Tensor | None = None,
              extra: int = 0) -> list[Request]:
        count = 0 if data is None else data.numel()
        code = 0 if data is None else DTYPES.index(data.dtype)
        reqs = [self._net.isend(torch.tensor([op, idx, count, code, extra], dtype=torch.int64), dest, _HDR)]
        if data is not None:
            reqs.append(self._net.isend(data, dest, _DATA))
        return reqs

    # -- worker side -----------------------------------------------------------------------------
    def _check_worker(self, what: str) -> None:
        self._check_open()
        if self.is_server:
            raise KVStoreError(f"{what}: rank {self._world.rank} is a dist_sync server; "
                               f"it must call kv.serve()")

    def _registered(self, key: Key) -> None:
        """Worker 0 ships the initial value to the servers and waits for their acknowledgement, so
        no worker's push can reach a server before the key exists there."""
        if self.rank != 0:
            return
        info = self._keys[key]
        flat = info.store.view(-1)
        reqs, acks = [], []
        for s, lo, hi in self._shards(info):
            reqs += self._send(_INIT, info.index, s, flat[lo:hi].clone())
            ack = torch.zeros(1, dtype=torch.int64)
            acks.append(self._net.irecv(ack, s, _REPLY))
        Request.wait_all(reqs + acks)

    def init(self, key: Key | Sequence[Key], value: Any) -> None:
        self._check_worker("init")
        super().init(key, value)
        self._ctl.barrier()  # every worker sees the keys only after worker 0's INITs were acknowledged

    def push(self, key: Key | Sequence[Key], value: Any, priority: int = 0) -> None:
        """Send each worker's value to the key's servers; returns at once (the value is copied)."""
        self._check_worker("push")
        for k, v in pairs(key, value, "push"):
            src = tensors(v, f"push({k!r})")
            info = self._info(k, src[0], "push")
            flat = src[0].detach().reshape(-1).clone() if len(src) == 1 else _sum(src).view(-1)
            for s, lo, hi in self._shards(info):
                self._track(k, self._send(_PUSH, info.index, s, flat[lo:hi]), flat)

    def pull(self, key: Key | Sequence[Key], out: Any = None, priority: int = 0,
             ignore_sparse: bool = True) -> None:
        """Fetch the merged value of the latest round this worker pushed; returns with `out` complete."""
        self._check_worker("pull")
        items = pairs(key, out, "pull")
        for k, o in items:
            outs = tensors(o, f"pull({k!r})")
            info = self._info(k, outs[0], "pull")
            first = outs[0] if outs[0].is_contiguous() else torch.empty_like(info.store)
            flat = first.view(-1)
            for s, lo, hi in self._shards(info):
                req = self._net.irecv(flat[lo:hi], s, _REPLY)
                self._track(k, [*self._send(_PULL, info.index, s), req], first)
            self.wait(k)
            for t in outs:
                if t is not first:
                    t.copy_(first)

    def pushpull(self, key: Key | Sequence[Key], ins: Any, outs: Any = None, priority: int = 0) -> None:
        """push then pull: `outs` (default `ins`) receive the sum over workers (no optimizer set)."""
        if self._opt_factory is not None:
            raise KVStoreError("dist_sync pushpull is the plain sum, but an optimizer is set on the servers; "
                               "use push(key, grad) then pull(key, weight)")
        self.push(key, ins, priority)
        self.pull(key, ins if outs is None else outs, priority)

    def _track(self, key: Key, reqs: list[Request], keep: torch.Tensor) -> None:
        self._inflight.setdefault(key, []).extend(reqs)
        self._keep.setdefault(key, []).append(keep)

    def wait(self, keys: Key | Sequence[Key] | None = None) -> None:
        if self.is_server:
            return
        ks = list(self._inflight) if keys is None else [k for k, _ in pairs(keys, None, "wait")]
        for k in ks:
            for r in self._inflight.pop(k, []):
                wait_until(r.test, f"key {k!r}", self._policy, who=f"dist_sync worker rank {self._world.rank}")
            self._keep.pop(k, None)

    def _enqueue(self, entry: Entry, priority: int) -> None:  # pragma: no cover - push/pull overridden
        raise KVStoreError("dist_sync moves data with push/pull")

    def set_optimizer(self, optimizer: Any) -> None:
        """Ship the optimizer (class + defaults, or a picklable factory) to every server; the servers
        step their shards with the summed gradient of each round."""
        self._check_worker("set_optimizer")
        factory = make_optimizer_factory(optimizer)
        blob = pickle.dumps(optimizer if not isinstance(optimizer, torch.optim.Optimizer)
                            else (type(optimizer), dict(optimizer.defaults)))
        self.wait()
        self._opt_factory = factory
        self._ctl.barrier()
        if self.rank == 0:
            self._to_all_servers(_SETOPT, blob)
        self._ctl.barrier()

    def _to_all_servers(self, op: int, blob: bytes) -> list[Any]:
        """Worker 0: send a pickled control message to every server; returns their pickled replies."""
        replies = []
        for s in self._server_ranks:
            Request.wait_all(self._send(op, 0, s, _pack(blob), extra=len(blob)))
            replies.append(_recv_blob(self._net, s))
        return replies

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Collective over workers: worker 0 gathers the servers' optimizer states into `fname`."""
        self._check_worker("save_optimizer_states")
        if self._opt_factory is None:
            raise KVStoreError("save_optimizer_states: no optimizer set (call set_optimizer first)")
        self.wait()
        self._ctl.barrier()
        if self.rank == 0:
            states = [pickle.loads(b) for b in self._to_all_servers(_SAVE, b"")]
            torch.save({s: st for s, st in zip(self._server_ranks, states)}, fname)
        self._ctl.barrier()

    def load_optimizer_states(self, fname: str) -> None:
        """Collective over workers: worker 0 sends each server its saved optimizer state."""
        self._check_worker("load_optimizer_states")
        if self._opt_factory is None:
            raise KVStoreError("load_optimizer_states: no optimizer set (call set_optimizer first)")
        self.wait()
        self._ctl.barrier()
        if self.rank == 0:
            saved = torch.load(fname, weights_only=False)
            for s in self._server_ranks:
                blob = pickle.dumps(saved[s])
                Request.wait_all(self._send(_LOAD, 0, s, _pack(blob), extra=len(blob)))
                _recv_blob(self._net, s)
        self._ctl.barrier()

    def set_gradient_compression(self, compression_params: dict) -> None:
        raise KVStoreError("dist_sync does not compress pushes; use an allreduce kvstore for compression")

    def broadcast(self, key: Any, value: Any, out: Any, root_rank: int = 0, priority: int = 0) -> None:
        self._check_worker("broadcast")
        super().broadcast(key, value, out, root_rank, priority)

    def barrier(self) -> None:
        self._check_worker("barrier")
        super().barrier()

    # -- server side -----------------------------------------------------------------------------
    def serve(self) -> None:
        """Run the server loop on a server rank until every worker has closed the store."""
        if not self.is_server:
            raise KVStoreError(f"serve(): rank {self._world.rank} is a worker, not a dist_sync server")
        from .shard import ServerLoop

        ServerLoop(self._net, self._nworkers, self._policy.warn_after).run()
        self._closed = True
        self._shutdown()
        self._ctl.free()

    def _shutdown(self) -> None:
        if not self.is_server:
            reqs = []
            for s in self._server_ranks:
                reqs += self._send(_CLOSE, 0, s)
            Request.wait_all(reqs)
        self._net.free()


def _sum(ts: list[torch.Tensor]) -> torch.Tensor:
    out = ts[0].detach().clone().contiguous()
    for t in ts[1:]:
        out.add_(t)
    return out


def _pack(blob: bytes) -> torch.Tensor:
    """Bytes as an int32 tensor (padded to 4 bytes): control messages only."""
    padded = blob + b"\0" * (-len(blob) % 4)
    if not padded:
        return torch.zeros(1, dtype=torch.int32)
    return torch.frombuffer(bytearray(padded), dtype=torch.int32)


def _recv_blob(comm: Communicator, source: int) -> bytes:
    n = torch.zeros(1, dtype=torch.int64)
    comm.recv(n, source, _REPLY)
    buf = torch.zeros(max(1, (int(n) + 3) // 4), dtype=torch.int32)
    comm.recv(buf, source, _REPLY)
    return buf.numpy().tobytes()[: int(n)]
