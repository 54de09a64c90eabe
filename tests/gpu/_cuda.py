"""The marks every CUDA test carries: ``gpu``, and a skip that says why where torch sees no GPU."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
REASON = ("no CUDA device: torch.cuda.is_available() is False here; these tests run on a GPU machine "
          "with `make test-gpu` (docs/gpu.md)")

needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason=REASON)]
