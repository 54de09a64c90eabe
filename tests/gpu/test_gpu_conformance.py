"""The real-model conformance suites on CUDA: each device-parameterised test (one that takes the `device`
fixture, tests/conftest.py) is imported here and collected again, with `device` this rank's GPU
(tests/gpu/conftest.py), at 2, 3 and 4 ranks sharing the GPU(s) in `make test-gpu`. Same names, same
comparisons with one process (on the same GPU, float64). A suite plugs in by taking `device`, building
its model ``.to(device)`` (batches may stay on the CPU: fit and the trainers move them) and comparing
on the CPU, then by being imported below."""

from __future__ import annotations

import pytest

from tests.gpu._cuda import needs_cuda
from tests.spatial.test_real_models import test_torchvision_model_trains_as_one_process_on_every_grid  # noqa: F401
from tests.strategies.pipeline.test_transformers_mpi import (  # noqa: F401
    test_default_config_transformer_trains_like_one_process_under_every_strategy_and_schedule,
)

pytestmark = [pytest.mark.mpi, *needs_cuda]
