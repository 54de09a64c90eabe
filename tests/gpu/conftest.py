"""CUDA tests compare with one process within float32 rounding: no TF32 (cuDNN uses it for convolutions by
default on Ampere and later, ~1e-3 relative) and deterministic cuDNN kernels. Under tests/gpu the `device`
fixture (tests/conftest.py: the CPU) is this rank's GPU, so a device-parameterised suite collected here
runs on CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.gpu._cuda import HAS_CUDA, REASON


@pytest.fixture(autouse=True, scope="session")
def _exact_cuda_math():
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic = saved


@pytest.fixture(scope="session")
def device(comm):
    """This rank's GPU (``mpitrain.init`` binds rank -> cuda:local_rank % count). On the torch backend
    (NCCL) only with a GPU per rank: NCCL refuses two ranks on one device, so ranks sharing a GPU go
    through the MPI backend."""
    import mpitrain

    if not HAS_CUDA:
        pytest.skip(REASON)
    if comm.backend != "mpi" and torch.cuda.device_count() < comm.size:
        pytest.skip(f"NCCL needs a GPU per rank: {torch.cuda.device_count()} GPUs for {comm.size} ranks")
    return mpitrain.device()
