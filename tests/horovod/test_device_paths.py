"""The device-generic paths of mpitrain.horovod on the CPU: the engine over the MPI backend's host staging
(what CUDA tensors take when MPI is not CUDA-aware), forced for CPU tensors, gives bitwise the direct path's
results for every collective and for DistributedOptimizer training, which equals one process; Adam state
(a CPU ``step`` beside the moments) broadcasts whole; a tensor on a device nobody takes is refused on the
calling rank. tests/gpu/test_gpu_horovod.py runs the same checks on CUDA tensors."""

from __future__ import annotations

import pytest
import torch

import mpitrain.horovod as hvd
from mpitrain.comm.compose import direct_devices, mpi_communicator
from mpitrain.horovod._basics import state
from tests.helpers import assert_all_ranks
from tests.strategies import _device_checks as dc

from . import _device_checks as hc
from ._util import raises_everywhere

pytestmark = pytest.mark.mpi
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _init():
    hvd.init()


@pytest.fixture(scope="module")
def staged(comm):
    if comm.backend != "mpi":
        pytest.skip("host staging is the MPI backend's path")
    return mpi_communicator(comm.mpi_comm, direct=frozenset())


def test_collectives_over_staging_are_bitwise_the_direct_path(comm, staged):
    direct = hc.run_collectives(CPU)
    with hc.engine_over(staged):
        stages = "cpu" not in direct_devices(state().engine.comms[0])
        assert_all_ranks(comm, stages, "the engine's communicator must stage")
        through_host = hc.run_collectives(CPU)
    hc.assert_same_results(comm, through_host, direct)


def test_distributed_optimizer_over_staging_is_bitwise_the_direct_path_and_one_process(comm, staged):
    direct = hc.train_distributed_optimizer(CPU)
    with hc.engine_over(staged):
        through_host = hc.train_distributed_optimizer(CPU)
    dc.assert_bitwise(comm, through_host, direct, "DistributedOptimizer staged vs direct")
    dc.assert_one_process(comm, direct, dc.train_one_process(comm.size, CPU), "DistributedOptimizer vs one process")


def test_broadcast_optimizer_state_sends_adam_state_whole(comm):
    hc.assert_adam_state_broadcast(comm, CPU)


def test_tensor_on_an_unsupported_device_is_refused_saying_which(comm):
    msg = raises_everywhere(comm, ValueError, lambda: hvd.allreduce_async(torch.zeros(3, device="meta")),
                            "takes CPU and CUDA tensors")
    assert "meta" in msg
