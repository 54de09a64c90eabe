"""Shared fixtures. Tests marked `mpi` run inside MPI jobs at 2, 3 and 4 ranks (see tests/README.md)."""

from __future__ import annotations

import os

import pytest


def _world_size() -> int:
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if var in os.environ:
            return int(os.environ[var])
    return 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip mpi tests whose `min_size`/`sizes` exclude this world size (the same verdict on every rank)."""
    size = _world_size()
    for item in items:
        marker = item.get_closest_marker("mpi")
        if marker is None:
            continue
        sizes = marker.kwargs.get("sizes")
        if size < marker.kwargs.get("min_size", 2) or (sizes is not None and size not in sizes):
            item.add_marker(pytest.mark.skip(reason=f"needs world size in {sizes or '>=min_size'}, have {size}"))


@pytest.fixture(scope="session")
def comm():
    """The world communicator of the backend named by MPITRAIN_BACKEND (default mpi)."""
    import mpitrain

    return mpitrain.init()


@pytest.fixture(scope="session")
def device():
    """Where the device-parameterised suites (the real-model conformance suites) build their models:
    the CPU. tests/gpu/conftest.py overrides it with this rank's GPU, and tests/gpu/test_gpu_conformance.py
    collects those suites' tests again under that override (docs/gpu.md, "GPU conformance")."""
    import torch

    return torch.device("cpu")
