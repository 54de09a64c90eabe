"""The device-agnostic paths of DataParallel, fit(strategy="data"), pipelines and spatial on the CPU: over the MPI
backend's host-staging path (what CUDA buckets take when MPI is not CUDA-aware), forced for CPU tensors,
bitwise the direct path's parameters; and within float32 rounding of one process."""

from __future__ import annotations

import pytest
import torch

from mpitrain.comm.compose import mpi_communicator
from tests.strategies import _device_checks as dc

pytestmark = pytest.mark.mpi
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def staged(comm):
    if comm.backend != "mpi":
        pytest.skip("host staging is the MPI backend's path")
    return mpi_communicator(comm.mpi_comm, direct=frozenset())


@pytest.mark.parametrize("kvstore", ["dist_sync_mpi", "depchain"])
def test_data_parallel_over_staging_is_bitwise_the_direct_path(comm, staged, kvstore):
    direct = dc.train_data_parallel(comm, kvstore, CPU)
    through_host = dc.train_data_parallel(staged, kvstore, CPU)
    dc.assert_bitwise(comm, through_host, direct, f"DataParallel/{kvstore} staged vs direct")
    dc.assert_one_process(comm, through_host, dc.train_one_process(comm.size, CPU), f"{kvstore} vs one process")


def test_fit_data_over_staging_is_bitwise_the_direct_path(comm, staged):
    direct = dc.train_fit(comm, CPU)
    through_host = dc.train_fit(staged, CPU)
    dc.assert_bitwise(comm, through_host, direct, "fit(data) staged vs direct")
    dc.assert_one_process(comm, through_host, dc.train_one_process(comm.size, CPU), "fit(data) vs one process")


def test_synchronous_pipe_sgd_on_the_cpu_equals_one_process(comm):
    """The device-parameterised pipe-sgd check the GPU suite runs on CUDA, here on the CPU."""
    dc.assert_one_process(comm, dc.train_pipe_sgd_sync(comm, CPU), dc.train_one_process(comm.size, CPU),
                          "pipe-sgd K=1")


def test_pipeline_over_staging_is_bitwise_the_direct_path(comm, staged):
    """The device-parameterised model/hybrid check the GPU suite runs on CUDA, here on the CPU, direct
    and with every message staged (sends queued to the staged-send thread)."""
    ref = dc.train_pipeline_one_process(comm.size, CPU)
    for strategy, parts in dc.pipeline_layouts(comm.size):
        direct = dc.train_pipeline(comm, CPU, strategy, parts)
        dc.assert_bitwise(comm, dc.train_pipeline(staged, CPU, strategy, parts), direct, f"{strategy} staged")
        dc.assert_one_process(comm, direct, ref, f"{strategy} P={parts}")


@pytest.mark.parametrize("thin", [False, True], ids=["mesh", "whole-block-halos"])
def test_spatial_over_staging_is_bitwise_the_direct_path(comm, staged, thin):
    """The device-parameterised spatial check the GPU suite runs on CUDA, here on the CPU, direct and
    with every halo staged. "whole-block-halos": each rank sends its whole block, a view of an
    activation that requires grad, which the staged-send thread (grad mode on) failed to copy and left
    both ranks waiting for each other (the CUDA hang of ResNet-18, issue #30)."""
    got, ref = dc.train_spatial(comm, CPU, thin=thin)
    dc.assert_bitwise(comm, dc.train_spatial(staged, CPU, thin=thin)[0], got, "spatial staged")
    dc.assert_one_process(comm, got, ref, "spatial")
