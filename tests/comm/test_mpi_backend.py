"""MPI-backend details that need no job: how large allreduces are cut into pieces."""

from __future__ import annotations

import torch

from mpitrain.comm import _mpi as mpi


def test_pieces_are_in_order_views_of_the_tensor():
    t = torch.arange(mpi.SPLIT_ABOVE // 4 + 3, dtype=torch.float32)
    parts = mpi.pieces(t)
    k = mpi.SPLIT_ABOVE // mpi.SEGMENT_BYTES
    assert [p.numel() for p in parts] == [mpi.SEGMENT_BYTES // 4] * k + [3]
    assert all(p.data_ptr() == t.data_ptr() + i * mpi.SEGMENT_BYTES for i, p in enumerate(parts))
    assert len(mpi.pieces(torch.zeros(mpi.SPLIT_ABOVE // 4))) == 1  # at the threshold: whole
