"""The hierarchical allreduce on one machine, hosts emulated by rank parity (Hierarchy's `host_of`):
bitwise equal to a flat allreduce at 2, 3 and 4 ranks, through the communicator's own allreduce."""

from __future__ import annotations

import pytest

from tests.helpers import assert_all_ranks
from tests.multihost.exactness import compare_with_flat


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_hierarchical_allreduce_equals_a_flat_allreduce_bitwise(comm):
    if comm.backend != "mpi":
        pytest.skip("the hierarchical allreduce belongs to the mpi backend")  # same verdict on every rank
    from mpitrain.comm._hierarchical import Hierarchy
    from mpitrain.comm._mpi import MPICommunicator

    sub = MPICommunicator(comm.mpi_comm.Dup())
    sub._hierarchy = Hierarchy(sub.mpi_comm, ring_comm=lambda c: MPICommunicator(c, hierarchy=False),
                               host_of=comm.rank % 2)  # hosts {0, 2}, {1, 3}: leaders 0 and 1
    try:
        failures = compare_with_flat(sub)
        hosts = sub._hierarchy.hosts
    finally:
        sub.free()
    assert_all_ranks(comm, not failures and hosts == 2, f"hosts {hosts}, failures {failures}")
