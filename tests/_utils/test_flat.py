"""_utils/flat: joined() finds tensors that already lie back to back in one buffer."""

from __future__ import annotations

import torch

from mpitrain._utils.flat import joined, views


def test_joined_is_the_buffer_of_consecutive_views_and_none_otherwise():
    buffer = torch.zeros(10)
    a, b, c = views(buffer, [(2, 2), (3,), (3,)])
    span = joined([a, b, c])
    assert span is not None and span.shape == (10,) and span.data_ptr() == buffer.data_ptr()
    span += 1  # the views themselves change: no copy
    assert torch.equal(a, torch.ones(2, 2)) and torch.equal(c, torch.ones(3))
    tail = joined([b, c])
    assert tail is not None and tail.data_ptr() == b.data_ptr() and tail.numel() == 6
    assert joined([a, c]) is None  # a gap
    assert joined([b, a]) is None  # out of order
    assert joined([buffer[::2]]) is None  # not contiguous
    assert joined([torch.ones(3), torch.ones(3)]) is None  # two storages
    assert joined([]) is None
