"""Test helpers for SPMD tests: verdicts that every rank reaches together."""

from __future__ import annotations

import torch

__all__ = ["assert_all_ranks", "assert_close_all_ranks"]


def assert_all_ranks(comm, ok: bool, msg: str = "") -> None:
    """Fail on *every* rank if `ok` is false on any rank (a rank-local failure would hang the others)."""
    verdicts = comm.allgather_object((bool(ok), msg if not ok else ""))
    bad = [(r, m) for r, (v, m) in enumerate(verdicts) if not v]
    assert not bad, "failed on ranks " + "; ".join(f"{r}: {m}" for r, m in bad)


def assert_close_all_ranks(comm, actual: torch.Tensor, expected: torch.Tensor, atol: float = 0.0,
                           rtol: float = 0.0, what: str = "") -> None:
    """`actual` equals `expected` within tolerances on every rank; the message names rank and max error."""
    same_shape = actual.shape == expected.shape
    ok = same_shape and torch.allclose(actual.double(), expected.double(), atol=atol, rtol=rtol)
    err = (actual.double() - expected.double()).abs().max().item() if same_shape and actual.numel() else 0.0
    assert_all_ranks(comm, ok, f"{what} shape {tuple(actual.shape)} vs {tuple(expected.shape)}, max abs err {err}")
