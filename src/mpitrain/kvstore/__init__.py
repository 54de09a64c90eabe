"""KVStore: MXNet's key-value API over MPI collectives (local, funnel, concurrent, depchain,
dist_sync_mpi) and a parameter-server baseline (dist_sync)."""

from __future__ import annotations

import importlib
from typing import Any

from ..comm.base import Communicator
from .base import KVStore, KVStoreError

__all__ = ["create", "TYPES", "KVStore", "KVStoreError"]

#: type name -> "module:class"; each class docstring says how it orders collectives across ranks.
TYPES = {
    "local": "local:LocalStore",
    "funnel": "funnel:FunnelStore",
    "concurrent": "concurrent:ConcurrentStore",
    "depchain": "depchain:DepChainStore",
    "dist_sync_mpi": "coordinator:CoordinatorStore",
    "dist_sync": "server:ServerStore",
}


def create(name: str = "local", comm: Communicator | None = None, **options: Any) -> KVStore:
    """A new KVStore of type `name` over `comm` (default: the world communicator of
    :func:`mpitrain.init`; ``local`` uses a one-process communicator).

    Collective over `comm` for every type but ``local`` (it splits private communicators, so the
    store's traffic never mixes with the caller's). `options` go to the type's constructor, e.g.
    ``num_comms``/``outstanding`` (concurrent), ``stall_timeout``/``stall_abort`` (dist_sync_mpi),
    ``num_servers`` (dist_sync), ``warn_after`` (all).
    """
    if name not in TYPES:
        raise KVStoreError(f"unknown kvstore type {name!r}; choose one of {sorted(TYPES)}")
    module, cls_name = TYPES[name].split(":")
    cls = getattr(importlib.import_module(f"{__name__}.{module}"), cls_name)
    if comm is None and name != "local":
        from ..runtime import init

        comm = init()
    try:
        return cls(comm, **options) if comm is not None else cls(**options)
    except TypeError as e:
        raise KVStoreError(f"kvstore {name!r}: bad option ({e})") from e
