"""init() binds each rank to a device: a pure function of local rank, device count and the opt-out."""

from __future__ import annotations

import pytest
import torch

import mpitrain
from mpitrain.runtime import device_for


@pytest.mark.parametrize(("local_rank", "count", "expected"), [
    (0, 1, "cuda:0"), (1, 1, "cuda:0"), (3, 1, "cuda:0"),   # ranks share one GPU
    (0, 4, "cuda:0"), (3, 4, "cuda:3"), (5, 4, "cuda:1"),   # round-robin beyond the count
    (0, 0, "cpu"), (7, 0, "cpu"),                           # no CUDA device: the CPU
])
def test_device_for_is_local_rank_modulo_device_count(local_rank: int, count: int, expected: str) -> None:
    assert device_for(local_rank, count) == torch.device(expected)


@pytest.mark.parametrize("count", [0, 1, 8])
def test_device_for_opt_out_gives_the_cpu(count: int) -> None:
    assert device_for(2, count, bind=False) == torch.device("cpu")


def test_device_for_refuses_negative_arguments() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        device_for(-1, 2)
    with pytest.raises(ValueError, match="must be >= 0"):
        device_for(0, -2)


def test_device_after_init_is_this_hosts_binding() -> None:
    mpitrain.init()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expected = device_for(mpitrain.local_rank() if count else 0, count)
    assert mpitrain.device() == expected
    if expected.type == "cuda":
        assert torch.cuda.current_device() == expected.index
