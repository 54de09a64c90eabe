"""The `dist_sync` KVStore: a parameter-server baseline (the last S ranks serve shards of the keys).

Workers push values to the servers and pull the merged result back, as MXNet's ``dist_sync`` does;
it exists so the comparisons of the MPI-allreduce proposal and Pipe-SGD can be reproduced. A key of
at least `bigarray_bound` elements is split over all servers (contiguous blocks of the flattened
value, by :func:`split_sizes`); a smaller key lives whole on server ``init_index % S``. Servers run
:meth:`ServerStore.serve` until every worker has closed. The messages are :mod:`._protocol`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .._utils.flat import spans
from .._utils.stall import wait_until
from ..comm.base import Communicator, Request, split_sizes
from . import _protocol as proto
from ._interface import (
    Key,
    KeyInfo,
    KVStore,
    KVStoreError,
    Registry,
    make_optimizer_factory,
    pairs,
    split_private,
    stall_policy,
    tensors,
)

__all__ = ["ServerStore"]


class ServerStore(KVStore):
    """Ordering: no collectives on the data path; per-key rounds on each server make the result of a
    pull the merge of every worker's push of the same round (synchronous SGD). ``push`` returns at
    once; ``pull`` returns complete. With ``set_optimizer`` the update runs on the servers, and
    ``pushpull`` (a plain sum) is refused: use push then pull. Worker ranks call the interface;
    server ranks call only :meth:`serve` (and ``close``)."""

    type = "dist_sync"

    def __init__(self, comm: Communicator, num_servers: int = 1, bigarray_bound: int = 1_000_000,
                 warn_after: float = 60.0, abort_after: float | None = 600.0) -> None:
        if not 1 <= num_servers < comm.size:
            raise KVStoreError(f"dist_sync needs 1 <= num_servers < world size ({comm.size}), "
                               f"got {num_servers}")
        self._policy = stall_policy(warn_after, abort_after)
        self._world = comm
        self._nservers = num_servers
        self._nworkers = comm.size - num_servers
        self._server_ranks = list(range(self._nworkers, comm.size))
        self.is_server = comm.rank >= self._nworkers
        self._ctl = split_private(comm, int(self.is_server))  # workers' (or servers') main-thread collectives
        self._registry = Registry(self._ctl)
        self._net = split_private(comm)  # the protocol's traffic, apart from the caller's
        self._bound = bigarray_bound
        self._opt_set = False
        self._inflight: dict[Key, list[Request]] = {}
        self._keep: dict[Key, list[torch.Tensor]] = {}
        self._closed = False

    # -- identity --------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._ctl.rank

    @property
    def num_workers(self) -> int:
        return self._nworkers

    @property
    def num_servers(self) -> int:
        return self._nservers

    # -- placement -------------------------------------------------------------------------------
    def _shards(self, info: KeyInfo) -> list[tuple[int, int, int]]:
        """(server rank, start, stop) blocks of the flattened key."""
        n = math.prod(info.shape)
        if n < self._bound or self._nservers == 1:
            return [(self._server_ranks[info.index % self._nservers], 0, n)]
        blocks = zip(self._server_ranks, spans(split_sizes(n, self._nservers)))
        return [(s, lo, hi) for s, (lo, hi) in blocks if hi > lo]

    # -- worker side -----------------------------------------------------------------------------
    def _check_worker(self, what: str) -> None:
        if self._closed:
            raise KVStoreError(f"this {self.type} kvstore is closed")
        if self.is_server:
            raise KVStoreError(f"{what}: rank {self._world.rank} is a dist_sync server; "
                               f"it must call kv.serve()")

    def init(self, key: Key | Sequence[Key], value: Any, *, pushpull_only: bool = False) -> None:
        """Collective over workers. Worker 0 ships each initial value to the servers and waits for
        their acknowledgement; the barrier after it makes every worker see the keys only then, so no
        push can reach a server before the key exists there. With `pushpull_only` the workers keep no
        copy of the value (the servers hold theirs, as for every key) and the keys take only
        ``pushpull``/``wait`` (see :mod:`mpitrain.kvstore._interface`)."""
        self._check_worker("init")
        items = self._registry.items(key, value)
        self.wait()
        self._registry.register(items, keep=not pushpull_only)
        if self.rank == 0:
            for k, t in items:  # the caller's value is rank 0's: the stored one, where there is one
                self._ship(self._registry.keys[k], t)
        self._ctl.barrier()

    def held_bytes(self) -> int:
        """Bytes of stored values this worker holds (0 for ``pushpull_only`` keys; the servers' not counted)."""
        return self._registry.held_bytes()

    def _ship(self, info: KeyInfo, value: torch.Tensor) -> None:
        flat = value.detach().to("cpu").reshape(-1)
        reqs, acks = [], []
        for s, lo, hi in self._shards(info):
            reqs += proto.send(self._net, s, proto.INIT, info.index, flat[lo:hi].clone())
            acks.append(self._net.irecv(torch.zeros(1, dtype=torch.int64), s, proto.REPLY))
        Request.wait_all(reqs + acks)

    def push(self, key: Key | Sequence[Key], value: Any, priority: int = 0) -> None:
        """Send each worker's value to the key's servers; returns at once (the value is copied).
        `priority` is accepted for MXNet compatibility and unused."""
        self._check_worker("push")
        items = [(k, tensors(v, f"push({k!r})")) for k, v in pairs(key, value, "push")]
        for k, src in items:  # every key checked before the first is sent
            self._registry.value(k, src[0], "push")
        self._push(items)

    def _push(self, items: list[tuple[Key, list[torch.Tensor]]]) -> None:
        for k, src in items:
            info = self._registry.info(k, src[0], "push")
            flat = src[0].detach().reshape(-1).clone() if len(src) == 1 else _sum(src).view(-1)
            for s, lo, hi in self._shards(info):
                self._track(k, proto.send(self._net, s, proto.PUSH, info.index, flat[lo:hi]), flat)

    def pull(self, key: Key | Sequence[Key], out: Any = None, priority: int = 0,
             ignore_sparse: bool = True) -> None:
        """Fetch the merged value of the latest round this worker pushed; returns with `out` complete."""
        self._check_worker("pull")
        items = self._pull_items(key, out)
        for k, outs in items:  # every key checked before the first request is sent
            self._registry.value(k, outs[0], "pull")
        self._pull(items)

    def _pull_items(self, key: Key | Sequence[Key], out: Any) -> list[tuple[Key, list[torch.Tensor]]]:
        items = []
        for k, o in pairs(key, out, "pull"):
            if o is None:
                raise KVStoreError(f"pull({k!r}): pass `out`, the tensor(s) to copy the value into")
            items.append((k, tensors(o, f"pull({k!r})")))
        return items

    def _pull(self, items: list[tuple[Key, list[torch.Tensor]]]) -> None:
        for k, outs in items:
            info = self._registry.info(k, outs[0], "pull")
            first = outs[0] if outs[0].is_contiguous() else torch.empty(info.shape, dtype=info.dtype)
            flat = first.view(-1)
            for s, lo, hi in self._shards(info):
                req = self._net.irecv(flat[lo:hi], s, proto.REPLY)
                self._track(k, [*proto.send(self._net, s, proto.PULL, info.index), req], first)
            self.wait(k)
            for t in outs:
                if t is not first:
                    t.copy_(first)

    def pushpull(self, key: Key | Sequence[Key], ins: Any, outs: Any = None, priority: int = 0) -> None:
        """push then pull: `outs` (default `ins`) receive the sum over workers (no optimizer set)."""
        if self._opt_set:
            raise KVStoreError("dist_sync pushpull is the plain sum, but an optimizer is set on the servers; "
                               "use push(key, grad) then pull(key, weight)")
        self._check_worker("pushpull")
        items = [(k, tensors(v, f"pushpull({k!r})")) for k, v in pairs(key, ins, "pushpull")]
        out_items = self._pull_items(key, ins if outs is None else outs)
        for (k, src), (_, o) in zip(items, out_items):  # every key checked before the first is sent
            self._registry.info(k, src[0], "pushpull")
            self._registry.info(k, o[0], "pushpull outs")
        self._push(items)
        self._pull(out_items)

    def _track(self, key: Key, reqs: list[Request], keep: torch.Tensor) -> None:
        self._inflight.setdefault(key, []).extend(reqs)
        self._keep.setdefault(key, []).append(keep)

    def wait(self, keys: Key | Sequence[Key] | None = None) -> None:
        """This worker's sends and receives of `keys` are complete (a no-op on a server). Every
        `warn_after` seconds a line names the key; after `abort_after` seconds StallError."""
        if self.is_server:
            return
        ks = list(self._inflight) if keys is None else [k for k, _ in pairs(keys, None, "wait")]
        for k in ks:
            for r in self._inflight.pop(k, []):
                wait_until(r.test, f"key {k!r}", self._policy, who=f"dist_sync worker rank {self._world.rank}")
            self._keep.pop(k, None)

    def broadcast(self, key: Key | Sequence[Key], value: Any, out: Any, root_rank: int = 0,
                  priority: int = 0) -> None:
        """Collective over workers: as every type's broadcast, among the workers' copies (the servers'
        values are not involved)."""
        self._check_worker("broadcast")
        self._ctl._check_rank(root_rank, "root_rank")
        new = self._registry.new_keys(key, value, "broadcast")
        if new:
            self.init([k for k, _ in new], [v for _, v in new])
        self.wait()
        self._registry.broadcast(key, value, out, root_rank)

    def barrier(self) -> None:
        self._check_worker("barrier")
        self.wait()
        self._ctl.barrier()

    def set_optimizer(self, optimizer: Any) -> None:
        """Ship the optimizer (class + defaults, or a picklable factory) to every server; the servers
        step their shards with the summed gradient of each round."""
        self._check_worker("set_optimizer")
        make_optimizer_factory(optimizer)  # refuses what is neither an optimizer nor a factory
        spec = optimizer if not isinstance(optimizer, torch.optim.Optimizer) else (type(optimizer),
                                                                                 dict(optimizer.defaults))
        self.wait()
        self._opt_set = True
        self._ctl.barrier()
        if self.rank == 0:
            for s in self._server_ranks:
                proto.request(self._net, s, proto.SETOPT, spec)
        self._ctl.barrier()

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Collective over workers: worker 0 gathers the servers' optimizer states into `fname`."""
        self._check_optimizer("save_optimizer_states")
        if self.rank == 0:
            states = {s: proto.request(self._net, s, proto.SAVE, None) for s in self._server_ranks}
            torch.save(states, fname)
        self._ctl.barrier()

    def load_optimizer_states(self, fname: str) -> None:
        """Collective over workers: worker 0 sends each server its saved optimizer state."""
        self._check_optimizer("load_optimizer_states")
        if self.rank == 0:
            saved = torch.load(fname, weights_only=False)
            for s in self._server_ranks:
                proto.request(self._net, s, proto.LOAD, saved[s])
        self._ctl.barrier()

    def _check_optimizer(self, what: str) -> None:
        self._check_worker(what)
        if not self._opt_set:
            raise KVStoreError(f"{what}: no optimizer set (call set_optimizer first)")
        self.wait()
        self._ctl.barrier()

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        raise KVStoreError("dist_sync does not compress pushes; use an allreduce kvstore for compression")

    # -- server side -----------------------------------------------------------------------------
    def serve(self) -> None:
        """Run the server loop on a server rank until every worker has closed the store."""
        if not self.is_server:
            raise KVStoreError(f"serve(): rank {self._world.rank} is a worker, not a dist_sync server")
        from ._shard import ServerLoop

        ServerLoop(self._net, self._nworkers, self._policy.warn_after).run()
        self._release()

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Collective over the workers (idempotent): complete this worker's operations and tell every
        server; a server's ``serve`` returns once all workers closed."""
        if self._closed:
            return
        try:
            if not self.is_server:
                self.wait()
        finally:
            if not self.is_server:
                reqs = []
                for s in self._server_ranks:
                    reqs += proto.send(self._net, s, proto.CLOSE)
                Request.wait_all(reqs)
            self._release()

    def _release(self) -> None:
        if not self._closed:
            self._closed = True
            self._net.free()
            self._ctl.free()


def _sum(ts: list[torch.Tensor]) -> torch.Tensor:
    out = ts[0].detach().clone().contiguous()
    for t in ts[1:]:
        out.add_(t)
    return out
