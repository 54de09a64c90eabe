"""`mpitrain bench dataparallel --device cuda` says why and exits 2 where torch sees no GPU."""

from __future__ import annotations

import pytest
import torch

from mpitrain.bench.dataparallel import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the benchmark would run")
def test_device_cuda_without_a_gpu_exits_2_saying_why(capsys):
    assert main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "drop --device cuda" in err
