"""The Communicator interface and its backends (MPI by default).

What other packages use of comm is exported here; its private modules serve comm alone
(docs/ARCHITECTURE.md, Import rules)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._cuda import after, mpi_cuda_aware, ready_event
from ._inflight import settle_on_error
from ._rendezvous import host_leaders
from ._staging import Staging
from ._wait import wait_collective, wait_request
from .base import DTYPES, OPS, CommError, Communicator, Request, reduce_ops, split_sizes

if TYPE_CHECKING:
    from ._mpi import MPICommunicator
    from ._torchdist import TorchCommunicator, init_torch_world, torchrun_env

__all__ = ["Communicator", "Request", "CommError", "OPS", "DTYPES", "reduce_ops", "split_sizes",
           "after", "ready_event", "mpi_cuda_aware", "settle_on_error", "host_leaders", "Staging", "wait_request",
           "wait_collective",
           "MPICommunicator", "TorchCommunicator", "init_torch_world", "torchrun_env"]

#: The backends, imported on first use: importing mpi4py's MPI module initialises MPI, and torch.distributed
#: costs its import; name -> the module (in this package) that defines it.
_LAZY = {"MPICommunicator": "._mpi", "TorchCommunicator": "._torchdist", "init_torch_world": "._torchdist",
         "torchrun_env": "._torchdist"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'mpitrain.comm' has no attribute {name!r}")
