"""Host mirrors of the staging path: reused per dtype and size, handed back when an operation fails."""

from __future__ import annotations

import pytest
import torch

from mpitrain.comm._staging import Staging


def test_a_returned_mirror_is_lent_again_for_the_same_dtype_and_size():
    s = Staging()
    h = s.take(torch.zeros(3, 4))
    ptr = h.data_ptr()
    s.give(h)
    again = s.take(torch.zeros(12))  # same count, other shape: the same memory, viewed as asked
    assert again.data_ptr() == ptr and again.shape == (12,)
    other = s.take(torch.zeros(12, dtype=torch.float64))
    assert other.data_ptr() != ptr


def test_inplace_copies_in_runs_and_copies_back():
    s = Staging()
    t = torch.arange(6.0)
    seen = []
    s.inplace(t, lambda h: (seen.append(h.clone()), h.mul_(2)))
    assert torch.equal(seen[0], torch.arange(6.0)) and torch.equal(t, torch.arange(6.0) * 2)
    assert t.data_ptr() != seen[0].data_ptr()


def test_a_failing_operation_gives_its_mirror_back():
    s = Staging()

    def fail(h: torch.Tensor) -> None:
        raise RuntimeError("boom")

    t = torch.ones(5)
    with pytest.raises(RuntimeError, match="boom"):
        s.inplace(t, fail)
    assert torch.equal(t, torch.ones(5))  # untouched
    assert len(s._free[(torch.float32, 5)]) == 1
