"""fit's data rules (src/mpitrain/_data.py) on their own: the first-batch fingerprint and the batch count."""

from __future__ import annotations

import torch

from mpitrain._data import FINGERPRINT_ELEMENTS, _spread, batch_checksum, batch_count, global_batches


def test_fingerprint_reads_a_bounded_sample_from_every_row():
    """A ResNet-50-sized batch is fingerprinted from about FINGERPRINT_ELEMENTS elements, some in every
    row, and a small tensor from all of its elements."""
    x = torch.arange(64 * 3 * 224 * 224, dtype=torch.float32).reshape(64, 3, 224, 224)
    picked = _spread(x)
    assert picked.numel() <= FINGERPRINT_ELEMENTS
    rows = (picked // (3 * 224 * 224)).long()
    assert torch.equal(rows.unique(), torch.arange(64))
    small = torch.randn(8, 6)
    assert torch.equal(_spread(small), small.reshape(-1))
    tall = torch.arange(3 * FINGERPRINT_ELEMENTS).reshape(-1, 3)  # more rows than the limit: rows spread too
    assert _spread(tall).numel() == FINGERPRINT_ELEMENTS


def test_fingerprint_tells_other_order_rows_and_dtypes_apart_and_equal_batches_alike():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    base = batch_checksum((x, y))
    assert batch_checksum((x.clone(), y.clone())) == base
    assert batch_checksum((x[torch.randperm(64, generator=g)], y)) != base  # another shuffle
    other = x.clone()
    other[17] = torch.randn(3, 32, 32, generator=g)  # one sample replaced
    assert batch_checksum((other, y)) != base
    assert batch_checksum((x.double(), y)) != base
    assert batch_checksum(({"ids": y, "flag": True}, y)) != batch_checksum(({"ids": y, "flag": False}, y))
    odd = (torch.zeros(0, 3), torch.tensor(2.0), torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bfloat16))
    assert batch_checksum(odd) == batch_checksum(tuple(t.clone() for t in odd))


def test_batch_count_is_the_number_of_global_batches():
    for n in (1, 7, 8, 9, 16, 17):
        for drop_last in (False, True):
            assert batch_count(n, 8, drop_last) == len(global_batches(torch.arange(n), 8, drop_last))
