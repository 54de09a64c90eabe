"""The KVStore interface (MXNet's API) that every type offers, and the helpers every type shares:
argument checks, the key registry, the optimizer factory, the stall policy.

Semantics common to every type:

* ``init`` is collective over the workers: every worker registers the same keys with the same
  shape/dtype (checked with one pickled allgather, so a mismatch raises on every worker before any
  data moves) and rank 0's value becomes the stored value.
* ``init(..., pushpull_only=True)`` registers the keys' shape/dtype and stores **no** value (no copy,
  no broadcast): such a key is only ever summed by ``pushpull`` (and waited). ``push``, ``pull`` and
  ``broadcast`` of it raise :class:`KVStoreError` before any message moves (``pull``/``push`` on the
  worker that calls them: the registration is the same on every worker; ``broadcast`` on every
  worker, from its collective check). DataParallel registers its gradient buckets this way, so the
  store holds no copy of the gradients.
* ``push``/``pushpull``/``pull``/``broadcast`` return after queueing; ``wait(keys)`` returns when every
  operation issued so far on those keys is complete and their outputs are safe to read. ``pull`` and
  ``broadcast`` wait for the key themselves, so their output is complete when they return.
* ``pushpull(key, ins, outs)`` writes the **sum** over workers into `outs` (default `ins`; `outs` may
  be `ins`, then the sum is computed in place with no copy). Inputs must not be modified, nor outputs
  read, before ``wait`` covers the key.
* ``push(key, grad)`` reduces into the stored value: without an optimizer the stored value becomes
  the sum; with ``set_optimizer`` the optimizer steps the stored value with the summed gradient.
  ``pull(key, out)`` copies the stored value out. ``pushpull`` is always the plain sum.
* Every worker must issue the same multiset of operations between two synchronization points
  (``wait``, ``pull``, ``barrier``, ``broadcast``, ``init``); how each type orders its collectives
  is stated in its class docstring.
* ``priority=`` parameters are accepted for MXNet compatibility and unused: each type's ordering
  rule decides when an operation runs.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._utils.stall import StallPolicy
from ..comm.base import Communicator

__all__ = ["KVStore", "KVStoreError", "Key", "Value", "KeyInfo", "Registry", "make_optimizer_factory",
           "check_key", "pairs", "tensors", "stall_policy", "split_private", "log"]

log = logging.getLogger("mpitrain.kvstore")

Key = int | str
Value = torch.Tensor | Sequence[torch.Tensor]


class KVStoreError(RuntimeError):
    """Wrong use of a KVStore, or a cross-rank inconsistency (the message names keys and ranks)."""


def split_private(comm: Communicator, color: int = 0) -> Communicator:
    """Collective over `comm`: a new communicator of the ranks that pass the same `color` (same order),
    so a store's traffic never mixes with the caller's or with its own other channels."""
    sub = comm.split(color, comm.rank)
    if sub is None:  # only color=None joins no group
        raise KVStoreError(f"kvstore: splitting a private communicator with color {color} failed")
    return sub


def stall_policy(warn_after: float, abort_after: float | None) -> StallPolicy:
    """The store's limits on a wait (the `warn_after`/`abort_after` options of every type), checked."""
    try:
        return StallPolicy(warn_after, abort_after)
    except ValueError as e:
        raise KVStoreError(f"kvstore: {e}") from e


def make_optimizer_factory(opt: Any) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """An optimizer instance (its class and ``defaults`` are reused) or a callable params -> optimizer."""
    if isinstance(opt, torch.optim.Optimizer):
        cls, defaults = type(opt), dict(opt.defaults)
        return lambda params: cls(params, **defaults)
    if callable(opt):
        return opt  # type: ignore[no-any-return]
    raise KVStoreError(f"set_optimizer takes a torch.optim.Optimizer or a callable params -> optimizer, "
                       f"got {type(opt).__name__}")


def check_key(key: Any) -> Key:
    """`key` itself if it is an int or a string (not a bool), else KVStoreError."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise KVStoreError(f"keys are ints or strings, got {key!r} ({type(key).__name__})")
    return key


def pairs(key: Key | Sequence[Key], value: Any, what: str) -> list[tuple[Key, Any]]:
    """[(key, value)] for one key or a list of keys with a same-length list of values."""
    if isinstance(key, (list, tuple)):
        if value is None:
            return [(check_key(k), None) for k in key]
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            raise KVStoreError(f"{what}: {len(key)} keys need a list of {len(key)} values")
        return [(check_key(k), v) for k, v in zip(key, value)]
    return [(check_key(key), value)]


def tensors(value: Value, what: str) -> list[torch.Tensor]:
    """A value is one tensor or a list of tensors (one per device: they are summed first)."""
    ts: list[Any] = list(value) if isinstance(value, (list, tuple)) else [value]
    if not ts or not all(isinstance(t, torch.Tensor) for t in ts):
        raise KVStoreError(f"{what}: expected a tensor or a non-empty list of tensors, got {value!r}")
    return ts


@dataclass
class KeyInfo:
    """A registered key: its position in the init order, signature and stored value (None for a key
    registered ``pushpull_only``: nothing is stored for it)."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    store: torch.Tensor | None


class Registry:
    """The workers' registered keys and the collectives that keep them alike, over `ctl` (the workers'
    main-thread communicator; every method that says *collective* is called by all of its ranks in
    the same order)."""

    def __init__(self, ctl: Communicator) -> None:
        self.ctl = ctl
        self.keys: dict[Key, KeyInfo] = {}

    def check_same(self, sigs: list[Any], what: str, error: str | None = None) -> None:
        """Collective, one pickled allgather: every worker raises the same error if some worker found its
        own arguments wrong (`error`, named with its rank) or the workers' `sigs` differ (in content or
        order)."""
        everyone = self.ctl.allgather_object((error, sigs))
        errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(everyone) if e is not None]
        if errors:
            raise KVStoreError(f"{what}: {'; '.join(errors)}")
        if any(s != everyone[0][1] for _, s in everyone):
            lines = "; ".join(f"rank {r}: {s}" for r, (_, s) in enumerate(everyone))
            raise KVStoreError(f"{what}: workers passed different keys/shapes/dtypes (or order): {lines}")

    def items(self, key: Key | Sequence[Key], value: Any) -> list[tuple[Key, torch.Tensor]]:
        """The (key, first tensor) pairs of an ``init``, checked locally (not yet registered)."""
        items = [(k, tensors(v, f"init({k!r})")[0]) for k, v in pairs(key, value, "init")]
        for k, _ in items:
            if k in self.keys:
                raise KVStoreError(f"init: key {k!r} is already initialized")
        return items

    def register(self, items: list[tuple[Key, torch.Tensor]], keep: bool = True) -> list[Key]:
        """Collective: check the signatures (and `keep`) alike, then store rank 0's values (a broadcast
        per key, in order), or with ``keep=False`` (``init(..., pushpull_only=True)``) store nothing and
        move no data. Returns the keys, registered in the same order on every worker."""
        self.check_same([(k, tuple(t.shape), str(t.dtype), keep) for k, t in items], "init")
        for k, t in items:
            store = t.detach().to("cpu", copy=True).contiguous() if keep else None
            if store is not None:
                self.ctl.broadcast(store, 0)
            self.keys[k] = KeyInfo(len(self.keys), tuple(t.shape), t.dtype, store)
        return [k for k, _ in items]

    def info(self, key: Key, t: torch.Tensor | None, what: str) -> KeyInfo:
        """The registered key; KVStoreError if it is not, or if `t`'s shape/dtype differ from its own."""
        info = self.keys.get(key)
        if info is None:
            raise KVStoreError(f"{what}: key {key!r} is not initialized; call kv.init(key, value) first")
        if t is not None and (tuple(t.shape) != info.shape or t.dtype != info.dtype):
            raise KVStoreError(f"{what}: key {key!r} was initialized as {info.shape} {info.dtype}, "
                               f"got {tuple(t.shape)} {t.dtype}")
        return info

    def value(self, key: Key, t: torch.Tensor | None, what: str) -> torch.Tensor:
        """The key's stored value, checked as :meth:`info`; KVStoreError for a key registered
        ``pushpull_only`` (it has none). Local: decides the same on every worker (same registrations)."""
        store = self.info(key, t, what).store
        if store is None:
            raise KVStoreError(_no_value(key, what))
        return store

    def held_bytes(self) -> int:
        """Bytes of the stored values this worker holds (a ``pushpull_only`` key holds none)."""
        return sum(i.store.numel() * i.store.element_size() for i in self.keys.values() if i.store is not None)

    def new_keys(self, key: Key | Sequence[Key], value: Any, what: str) -> list[tuple[Key, Any]]:
        """Collective: the (key, value) pairs of `key` not yet registered, checked alike on every worker;
        a registered key without a stored value (``pushpull_only``) raises on every worker, before any data
        moves."""
        keys = pairs(key, value, what)
        bare = [k for k, _ in keys if k in self.keys and self.keys[k].store is None]
        new = [(k, v) for k, v in keys if k not in self.keys]
        self.check_same(sorted(str(k) for k, _ in new), f"{what} (keys not yet initialized)",
                        _no_value(bare[0], what) if bare else None)
        return new

    def broadcast(self, key: Key | Sequence[Key], value: Any, out: Any, root_rank: int) -> None:
        """Collective: root's `value` becomes each key's stored value and is copied into `out` on every
        worker (the keys must be registered; a broadcast per key, in order)."""
        outs = pairs(key, out, "broadcast outs")
        for (k, v), (_, o) in zip(pairs(key, value, "broadcast"), outs):
            src = tensors(v, "broadcast")[0]
            store = self.value(k, src, "broadcast")
            if self.ctl.rank == root_rank:
                store.copy_(src)
            self.ctl.broadcast(store, root_rank)
            for t in tensors(o, f"broadcast({k!r}) out"):
                t.copy_(store)


def _no_value(key: Key, what: str) -> str:
    return (f"{what}: key {key!r} was initialized with pushpull_only=True (as DataParallel registers its "
            f"gradient buckets): it has no stored value, so only pushpull and wait take it; init another "
            f"key for push/pull/broadcast")


class KVStore(abc.ABC):
    """A key-value store whose push/pull/pushpull sum values over the workers (see module doc).

    The interface every type offers (``isinstance(kv, mpitrain.kvstore.KVStore)`` holds for each)."""

    type: str = "?"

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This worker's rank among the workers."""

    @property
    @abc.abstractmethod
    def num_workers(self) -> int:
        """How many workers push and pull."""

    @abc.abstractmethod
    def init(self, key: Key | Sequence[Key], value: Value | Sequence[Value], *, pushpull_only: bool = False) -> None:
        """Collective over workers: register keys; rank 0's values become the stored values. With
        `pushpull_only` only their shape/dtype are registered: nothing is stored or sent, and the keys
        take only ``pushpull``/``wait`` (``push``/``pull``/``broadcast`` of them raise KVStoreError)."""

    @abc.abstractmethod
    def held_bytes(self) -> int:
        """Bytes of stored values this worker holds for its keys (0 for ``pushpull_only`` keys)."""

    @abc.abstractmethod
    def push(self, key: Key | Sequence[Key], value: Value | Sequence[Value], priority: int = 0) -> None:
        """Queue: stored value = sum over workers (or, with an optimizer, one step with that sum)."""

    @abc.abstractmethod
    def pull(self, key: Key | Sequence[Key], out: Any = None, priority: int = 0,
             ignore_sparse: bool = True) -> None:
        """Copy the stored value into `out` once earlier pushes of the key are done; returns complete."""

    @abc.abstractmethod
    def pushpull(self, key: Key | Sequence[Key], ins: Value | Sequence[Value], outs: Any = None,
                 priority: int = 0) -> None:
        """Queue ``outs = sum over workers of ins`` (default outs: ins)."""

    @abc.abstractmethod
    def broadcast(self, key: Key | Sequence[Key], value: Value | Sequence[Value], out: Any,
                  root_rank: int = 0, priority: int = 0) -> None:
        """Collective: initialize `key` (if new) with root's `value` and copy it into `out` everywhere."""

    @abc.abstractmethod
    def wait(self, keys: Key | Sequence[Key] | None = None) -> None:
        """Return once every operation issued so far on `keys` (all keys if None) is complete."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Complete this worker's outstanding operations, then a barrier over the workers."""

    @abc.abstractmethod
    def set_optimizer(self, optimizer: Any) -> None:
        """Later ``push`` steps the stored value with the summed gradient."""

    @abc.abstractmethod
    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Collective over workers: write the optimizer states to `fname`."""

    @abc.abstractmethod
    def load_optimizer_states(self, fname: str) -> None:
        """Read optimizer states written by ``save_optimizer_states``."""

    @abc.abstractmethod
    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress later reductions with codec ``compression_params["type"]`` (where supported)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Collective: complete everything and release threads and communicators (idempotent)."""

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<KVStore type={self.type} rank={self.rank} num_workers={self.num_workers}>"
