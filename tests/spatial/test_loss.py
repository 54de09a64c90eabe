"""Dense losses on blocks equal torch's on the whole tensor: value and input gradient, for cross-entropy
with ignore_index (a global count), class weights, label smoothing, class-probability targets, NLL, MSE
(plain and weighted), L1, smooth L1, Huber, BCE (with logits, pos_weight), KL divergence, every
reduction; targets as blocks, as this rank's part or as the whole tensor; spatial-only and sample x
spatial grids; and a replicated head's loss over sample groups."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpitrain.spatial import Distribution, SpatialError, gather
from mpitrain.spatial.tensor import plain
from tests.helpers import assert_all_ranks, assert_close_all_ranks

pytestmark = pytest.mark.mpi
RTOL = 1e-12
C, IGNORE = 4, 255


def layouts(size: int, index: int = 0) -> list[tuple[tuple[int, int], int]]:
    """A spatial-only grid (rows or columns split, alternating by `index`) and a sample x spatial one."""
    hybrid = {2: ((1, 1), 2), 3: ((1, 1), 3), 4: ((2, 1), 2) if index % 2 else ((1, 2), 2)}[size]
    return [((size, 1), 1) if index % 2 == 0 else ((1, size), 1), hybrid]


_DISTS: dict[tuple, Distribution] = {}


def distribution(comm, grid: tuple[int, int], samples: int) -> Distribution:
    """One Distribution per layout for the module (its communicators are split once), counters reset."""
    key = (id(comm), grid, samples)
    if key not in _DISTS:
        _DISTS[key] = Distribution(comm, grid, samples)
    _DISTS[key].redistributions.clear()
    return _DISTS[key]


def _data(size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shape = (3, C, size + 3, 5)  # 3 samples: uneven over 2 sample groups; uneven rows over the grid
    labels = torch.randint(0, C, (shape[0], *shape[2:]), generator=g)
    labels[0, :2] = IGNORE  # the first rows of sample 0: some blocks ignore more pixels than others
    labels[2, :, 3:] = IGNORE
    return {"y": torch.randn(shape, dtype=torch.float64, generator=g), "labels": labels,
            "probs": torch.softmax(torch.randn(shape, dtype=torch.float64, generator=g), 1),
            "values": torch.randn(shape, dtype=torch.float64, generator=g),
            "binary": torch.randint(0, 2, shape, generator=g).double(),
            "weight": torch.rand(shape, dtype=torch.float64, generator=g),
            "classes": torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)}


#: name -> (loss of (output, target), the target's key in the data, how the target is passed)
CASES: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], str, str]] = {
    "ce ignore_index mean": (lambda y, t: F.cross_entropy(y, t, ignore_index=IGNORE), "labels", "block"),
    "ce ignore_index sum": (lambda y, t: F.cross_entropy(y, t, ignore_index=IGNORE, reduction="sum"), "labels",
                            "whole"),
    "ce class weights": (lambda y, t: nn.CrossEntropyLoss(weight=_d["classes"], ignore_index=IGNORE)(y, t),
                         "labels", "local"),
    "ce label smoothing, weights": (lambda y, t: F.cross_entropy(y, t, weight=_d["classes"], ignore_index=IGNORE,
                                                                 label_smoothing=0.1), "labels", "block"),
    "ce class probabilities": (lambda y, t: F.cross_entropy(y, t, label_smoothing=0.05), "probs", "block"),
    "nll, weights": (lambda y, t: F.nll_loss(y, t, weight=_d["classes"], ignore_index=IGNORE), "labels", "block"),
    "mse mean": (lambda y, t: F.mse_loss(y, t), "values", "whole"),
    "mse weighted": (lambda y, t: F.mse_loss(y, t, weight=_d["weight_like"]), "values", "block"),
    "l1 sum": (lambda y, t: F.l1_loss(y, t, reduction="sum"), "values", "block"),
    "smooth l1": (lambda y, t: F.smooth_l1_loss(y, t, beta=0.5), "values", "block"),
    "huber": (lambda y, t: nn.HuberLoss(delta=0.7)(y, t), "values", "block"),
    "bce with logits, pos_weight": (lambda y, t: F.binary_cross_entropy_with_logits(
        y, t, pos_weight=torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64)[:, None, None]), "binary", "block"),
    "bce of sigmoid, weight": (lambda y, t: F.binary_cross_entropy(torch.sigmoid(y), t, weight=_d["weight_like"]),
                               "binary", "block"),
    "bce with logits, per-class weight": (lambda y, t: F.binary_cross_entropy_with_logits(
        y, t, weight=torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64)[:, None, None]), "binary", "whole"),
    "kl_div batchmean": (lambda y, t: F.kl_div(y, t, reduction="batchmean"), "probs", "block"),
    "ce none": (lambda y, t: F.cross_entropy(y, t, ignore_index=IGNORE, reduction="none"), "labels", "block"),
}
_d: dict[str, torch.Tensor] = {}  # operands the loss lambdas read (set per layout: whole or block)


@pytest.mark.parametrize("name", list(CASES))
def test_dense_loss_on_blocks_equals_the_whole_tensors_value_and_gradient(comm, name):
    fn, key, passed = CASES[name]
    data = _data(comm.size)
    y = data["y"].clone().requires_grad_()
    _d.update(classes=data["classes"], weight_like=data["weight"])
    want = fn(y, data[key])
    (want * torch.linspace(0.5, 1.5, want.numel(), dtype=torch.float64).view_as(want)).sum().backward()
    for grid, samples in layouts(comm.size, list(CASES).index(name)):
        dist = distribution(comm, grid, samples)
        ys_whole = data["y"].clone().requires_grad_()
        ys = dist.scatter(ys_whole)
        target = {"block": dist.scatter(data[key]), "whole": data[key],
                  "local": plain(dist.scatter(data[key]))}[passed]
        _d.update(weight_like=dist.scatter(data["weight"]))
        got = fn(ys, target)
        whole = gather(got) if name.endswith("none") else got
        (whole * torch.linspace(0.5, 1.5, whole.numel(), dtype=torch.float64).view_as(whole)).sum().backward()
        what = f"{name}, grid {grid} x{samples}"
        assert_close_all_ranks(comm, whole.detach(), want.detach(), rtol=RTOL, atol=1e-15, what=f"{what}: value")
        assert_close_all_ranks(comm, ys_whole.grad, y.grad, rtol=RTOL, atol=1e-15, what=f"{what}: dL/dy")
        assert_all_ranks(comm, dist.redistributions == {}, f"{what}: redistributed {dist.redistributions}")


def test_a_replicated_heads_mean_loss_averages_over_every_sample_group(comm):
    data = _data(comm.size)
    labels = data["labels"][:, 0, 0].clamp(max=C - 1)
    y = data["y"].clone().requires_grad_()
    want = F.cross_entropy(y.mean((2, 3)), labels, weight=data["classes"])
    want.backward()
    for grid, samples in layouts(comm.size):
        dist = distribution(comm, grid, samples)
        ys_whole = data["y"].clone().requires_grad_()
        got = F.cross_entropy(dist.scatter(ys_whole).mean((2, 3)), labels, weight=data["classes"])
        got.backward()
        what = f"grid {grid} x{samples}"
        assert_close_all_ranks(comm, got.detach(), want.detach(), rtol=RTOL, what=f"{what}: value")
        assert_close_all_ranks(comm, ys_whole.grad, y.grad, rtol=RTOL, atol=1e-15, what=f"{what}: dL/dy")


def test_a_target_laid_out_unlike_the_output_is_refused_on_every_rank(comm):
    dist = distribution(comm, (comm.size, 1), 1)
    data = _data(comm.size)
    try:
        F.cross_entropy(dist.scatter(data["y"]), data["labels"][:, 1:])
        msg = ""
    except SpatialError as e:
        msg = str(e)
    assert_all_ranks(comm, "neither this rank's part" in msg, msg)
