"""KVStore: MXNet's key-value API over MPI collectives (local, funnel, concurrent, depchain,
dist_sync_mpi) and a parameter-server baseline (dist_sync)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from .._utils.deprecation import renamed_options
from ..comm.base import Communicator
from ._interface import Key, KVStore, KVStoreError
from ._server import ServerStore

__all__ = ["create", "TYPES", "KVStore", "KVStoreError", "Key", "ServerStore"]

#: type name -> "module:class"; each class docstring says how it orders collectives across ranks.
TYPES = {
    "local": "_local:LocalStore",
    "funnel": "_funnel:FunnelStore",
    "concurrent": "_concurrent:ConcurrentStore",
    "depchain": "_depchain:DepChainStore",
    "dist_sync_mpi": "_coordinator:CoordinatorStore",
    "dist_sync": "_server:ServerStore",
}

#: options renamed in this release: type -> {old name: new name}; the old names warn (DeprecationWarning)
_RENAMED = {"dist_sync_mpi": {"stall_timeout": "warn_after", "stall_abort": "abort_after"}}


def create(name: str = "local", comm: Communicator | None = None, **options: Any) -> KVStore:
    """A new KVStore of type `name` over `comm` (default: the world communicator of
    :func:`mpitrain.init`; ``local`` uses a one-process communicator).

    Collective over `comm` for every type but ``local`` (it splits private communicators, so the
    store's traffic never mixes with the caller's). `options` go to the type's constructor, e.g.
    ``num_comms``/``outstanding`` (concurrent), ``fusion_bytes``/``lazy_thread`` (dist_sync_mpi), ``num_servers``
    (dist_sync), ``warn_after``/``abort_after`` (all: seconds before a stalled wait warns, and before
    it ends the job or raises). dist_sync_mpi's former ``stall_timeout``/``stall_abort`` still work for
    one release, with a DeprecationWarning.

    An option the type does not take raises :class:`KVStoreError` naming it and the valid ones, on
    every rank before any communication.
    """
    if name not in TYPES:
        raise KVStoreError(f"unknown kvstore type {name!r}; choose one of {sorted(TYPES)}")
    module, cls_name = TYPES[name].split(":")
    cls = getattr(importlib.import_module(f"{__name__}.{module}"), cls_name)
    options = renamed_options(options, _RENAMED.get(name, {}), f"kvstore.create({name!r})")
    valid = [p for p in inspect.signature(cls).parameters if p != "comm"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise KVStoreError(f"kvstore {name!r}: unknown option(s) {unknown}; valid options: {valid}")
    if comm is None and name != "local":
        from ..runtime import init

        comm = init()
    store: KVStore = cls(comm, **options) if comm is not None else cls(**options)
    return store
