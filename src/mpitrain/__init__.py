"""mpitrain: train ordinary PyTorch models across many processes over MPI."""

from __future__ import annotations

import importlib
from typing import Any

from .comm import CommError, Communicator, Request
from .runtime import init, local_rank, rank, size

__version__ = "0.1.0"

# Public names that live in heavier modules, imported on first use.
_LAZY = {
    "fit": "mpitrain.fit",
    "FitResult": "mpitrain.fit",
    "FitError": "mpitrain.fit",
    "DataParallel": "mpitrain.strategies.data_parallel",
    "broadcast_parameters": "mpitrain.strategies.data_parallel",
    "broadcast_optimizer_state": "mpitrain.strategies.data_parallel",
    "engine": "mpitrain.engine",
    "kvstore": "mpitrain.kvstore",
    "spatial": "mpitrain.spatial",
}

__all__ = [
    "init", "rank", "size", "local_rank",
    "Communicator", "Request", "CommError",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if module.__name__.endswith(name) else getattr(module, name)
    raise AttributeError(f"module 'mpitrain' has no attribute {name!r}")
