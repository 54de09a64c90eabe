"""``mpitrain.horovod``: the ``horovod.torch`` API (Horovod 0.28.1) on mpitrain's Communicator.

Switch a Horovod script with one line: ``import horovod.torch as hvd`` -> ``import mpitrain.horovod as hvd``
and launch it with ``mpitrain run -n N -- python script.py``. What is supported, what differs and
what is refused: docs/horovod.md.
"""

from __future__ import annotations

from typing import Any

from ._autograd import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    reducescatter,
)
from ._basics import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from ._compression import Compression
from ._functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ._mpi_ops import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    synchronize,
)
from ._optimizer import DistributedOptimizer
from ._process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from ._sync_batch_norm import SyncBatchNorm

__all__ = [
    # lifecycle and queries
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    # ops and errors
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError", "Compression",
    # collectives
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async",
    "synchronize", "poll", "join", "barrier",
    # process sets
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    # training helpers
    "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
    "allgather_object", "SyncBatchNorm",
]

#: Parts of horovod.torch that mpitrain.horovod refuses, with the reason given on access.
_REFUSED = {
    "elastic": "elastic training (hvd.elastic) is not supported by mpitrain.horovod",
    "sparse_allreduce_async": "sparse tensors are not supported by mpitrain.horovod",
}


def __getattr__(name: str) -> Any:
    if name in _REFUSED:
        raise AttributeError(f"module 'mpitrain.horovod' has no attribute {name!r}: {_REFUSED[name]}")
    raise AttributeError(f"module 'mpitrain.horovod' has no attribute {name!r}")
