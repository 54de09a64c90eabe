"""Dot-product tests: <A x, y> == <x, A* y> for the halo exchange, redistribution and scatter/gather,
with the distributed inner product summed over ranks."""

from __future__ import annotations

import pytest
import torch

from mpitrain.spatial import Distribution, gather, halo_exchange, plan_halo, redistribute, window_of
from mpitrain.spatial.tensor import plain
from tests.helpers import assert_all_ranks, assert_close_all_ranks

pytestmark = pytest.mark.mpi


def grids(size: int) -> list[tuple[int, int]]:
    return [(size, 1), (1, size)] + ([(2, 2)] if size == 4 else [])


def total(comm, t: torch.Tensor) -> float:
    """Sum over ranks of a local float64 scalar."""
    return float(comm.allreduce(t.detach().reshape(1).double().clone(), "sum"))


def rel_gap(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


WINDOWS = [(3, 1, 1, 1), (5, 2, 2, 1), (3, 1, 2, 2), (7, 1, 3, 1), (2, 1, "same", 3)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_halo_exchange_is_adjoint_to_its_backward(comm, window):
    gaps = []
    for grid in grids(comm.size):
        dist = Distribution(comm, grid, 1)
        size = (3 * grid[0] + 4, 3 * grid[1] + 3)
        plan = plan_halo(size, grid, window_of(*window), dist.spatial_rank)
        g = torch.Generator().manual_seed(comm.rank)
        x = torch.randn(2, 3, *plan.owned.shape, dtype=torch.float64, generator=g).requires_grad_()
        ext = halo_exchange(x, plan, dist.spatial_comm, 0.0)
        y = torch.randn(ext.shape, dtype=torch.float64, generator=g)
        (adj,) = torch.autograd.grad(ext, x, y)
        gaps.append(rel_gap(total(comm, (ext * y).sum()), total(comm, (x * adj).sum())))
    assert_all_ranks(comm, max(gaps) < 1e-12, f"<Hx,y> vs <x,H*y> relative gaps {gaps}")


def test_redistribution_is_adjoint_and_inverse_between_any_two_distributions(comm):
    dists = [Distribution(comm, g, 1) for g in grids(comm.size)] + [Distribution(comm, (1, 1), comm.size)]
    same = torch.Generator().manual_seed(5)  # the global tensor is the same on every rank
    shape = (comm.size + 1, 3, 2 * comm.size + 3, comm.size + 4)
    full = torch.randn(shape, dtype=torch.float64, generator=same)
    for a in dists:
        for b in dists:
            x = a.scatter(full).detach().requires_grad_()
            y = redistribute(x, a, b)
            assert_close_all_ranks(comm, gather(y), full, 0, 0, f"{a.grid}x{a.samples}->{b.grid}x{b.samples}")
            g = torch.Generator().manual_seed(comm.rank)
            w = torch.randn(y.shape, dtype=torch.float64, generator=g)
            (adj,) = torch.autograd.grad(y, x, w)
            gap = rel_gap(total(comm, (plain(y) * w).sum()), total(comm, (plain(x) * adj).sum()))
            same = torch.equal(plain(redistribute(y, b, a)), plain(x))
            assert_all_ranks(comm, gap < 1e-12 and same, f"{a.grid}->{b.grid}: adjoint gap {gap}, round trip {same}")


def test_gather_is_adjoint_to_scatter(comm):
    for grid in grids(comm.size):
        dist = Distribution(comm, grid, 1)
        same = torch.Generator().manual_seed(6)
        full = torch.randn(2, 3, 11, 10, dtype=torch.float64, generator=same).requires_grad_()
        block = dist.scatter(full)
        g = torch.Generator().manual_seed(comm.rank)
        w = torch.randn(block.shape, dtype=torch.float64, generator=g)
        (adj,) = torch.autograd.grad(block, full, w)  # scatter's adjoint: assemble, the same on every rank
        assert_close_all_ranks(comm, adj, gather(w, like=block), 0, 0, f"scatter* == gather, grid {grid}")
        lhs = total(comm, (plain(block) * w).sum())
        rhs = float((full.detach() * adj).sum())
        assert_all_ranks(comm, rel_gap(lhs, rhs) < 1e-12, f"dot test grid {grid}")
