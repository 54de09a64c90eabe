"""Shared helpers of the mpitrain.horovod tests: SPMD verdicts over the world communicator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tests.helpers import assert_all_ranks, assert_close_all_ranks

# Dtypes of Horovod's tests (Byte/Char/Short/Int/Long/Float/Double/Half tensors).
INT_TYPES = [torch.int32, torch.int64]
ALL_TYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
             torch.float64]


def raises_everywhere(comm: Any, exc: type[BaseException] | tuple[type[BaseException], ...],
                      fn: Callable[[], Any], match: str | None = None) -> str:
    """`fn()` raises `exc` on every rank (and the message contains `match`); returns this rank's message."""
    try:
        fn()
        ok, msg = False, "did not raise"
    except exc as e:  # type: ignore[misc]
        msg = str(e)
        ok = match is None or match in msg
    assert_all_ranks(comm, ok, msg)
    return msg


def same(comm: Any, actual: torch.Tensor, expected: torch.Tensor, what: str = "", tol: float = 0.0) -> None:
    assert_all_ranks(comm, actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}")
    assert_close_all_ranks(comm, actual, expected, atol=tol, what=what)


def close(comm: Any, actual: torch.Tensor, expected: torch.Tensor, what: str = "", tol: float = 0.0) -> None:
    assert_close_all_ranks(comm, actual, expected, atol=tol, what=what)
