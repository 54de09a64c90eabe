"""CUDA tests compare with one process within float32 rounding: no TF32 (cuDNN uses it for convolutions by
default on Ampere and later, ~1e-3 relative) and deterministic cuDNN kernels."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _exact_cuda_math():
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic = saved
