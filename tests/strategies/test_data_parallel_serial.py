"""Bucket planning and one-process DataParallel (kvstore "local"): plain training, gradients as views."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import mpitrain
from mpitrain.strategies._buckets import Bucket, plan_buckets
from mpitrain.strategies.data_parallel import DataParallel


def test_plan_buckets_fills_in_ready_order_per_dtype_never_past_the_cap():
    f, d = "float32", "float64"
    sizes = [(40, f), (400, f), (100, d), (300, f), (300, f), (50, d), (10, f)]
    # the first bucket of each dtype holds <= 30 bytes, later ones <= 500; dtypes never mix
    assert plan_buckets(sizes, cap_bytes=500, first_cap_bytes=30) == [[0], [1], [2], [3], [4, 6], [5]]
    assert plan_buckets(sizes, cap_bytes=10**9) == [[0, 1, 3, 4, 6], [2, 5]]
    # small items leave before a large neighbour, which then goes alone
    assert plan_buckets([(10, f), (10, f), (1000, f), (10, f)], 100, 50) == [[0, 1], [2], [3]]
    assert plan_buckets([(10**6, f)], cap_bytes=1) == [[0]]


def test_bucket_gradients_are_views_of_one_flat_buffer_with_used_slots():
    params = [nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.randn(4))]
    b = Bucket(0, "k", params)
    assert b.buffer.numel() == 6 + 4 + 2 and b.used.numel() == 2
    b.views[0].fill_(1.0)
    b.views[1].fill_(2.0)
    assert b.buffer[:10].tolist() == [1.0] * 6 + [2.0] * 4
    assert b.views[0].shape == (2, 3) and b.views[0].data_ptr() == b.buffer.data_ptr()


def test_one_rank_local_kvstore_equals_plain_training_and_grads_stay_bucket_views():
    comm = mpitrain.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    dp = DataParallel(model, kvstore="local", comm=comm, bucket_mb=0.0002, first_bucket_mb=0.0001)
    assert len(dp.buckets) >= 2
    opt = torch.optim.Adam(dp.parameters(), lr=0.01)
    ropt = torch.optim.Adam(ref.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()  # set_to_none: the next forward re-attaches the bucket views
        F.cross_entropy(dp(x), y).backward()
        for b in dp.buckets:
            for p, v in zip(b.params, b.views):
                assert p.grad.data_ptr() == v.data_ptr(), "gradient is not a view of its bucket"
        opt.step()
        ropt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ropt.step()
    dp.close()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_one_rank_no_sync_then_sync_equals_summed_gradients():
    comm = mpitrain.init()
    torch.manual_seed(2)
    model = nn.Linear(5, 2)
    ref = copy.deepcopy(model)
    dp = DataParallel(model, kvstore="local", comm=comm)
    xs = [torch.randn(4, 5) for _ in range(3)]
    for x in xs[:-1]:
        with dp.no_sync():
            dp(x).square().sum().backward()
    dp(xs[-1]).square().sum().backward()
    for x in xs:
        ref(x).square().sum().backward()
    dp.close()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0)


def test_second_gradient_in_one_synchronised_backward_raises_clearly():
    """A shared layer inside two reentrant checkpoints produces two gradients in one backward."""
    comm = mpitrain.init()
    shared = nn.Linear(4, 4)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(self.shared, x, use_reentrant=True)
            return checkpoint(self.shared, h, use_reentrant=True)

    dp = DataParallel(Twice(), kvstore="local", comm=comm)
    with pytest.raises(RuntimeError, match="second gradient"):
        dp(torch.randn(2, 4, requires_grad=True)).sum().backward()
    dp.close()
