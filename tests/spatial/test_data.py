"""Spatial input read by region: every rank reads only its own block of its own samples from a .npy
memory map, and fit(strategy="spatial") on such batches trains exactly as on full tensors."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mpitrain.fit import fit
from mpitrain.spatial import Distribution, NpyRegions, region_batches
from tests.helpers import assert_all_ranks, assert_close_all_ranks
from tests.spatial.test_trainer import hybrid_layouts, sgd

pytestmark = pytest.mark.mpi


class CountingRegions(NpyRegions):
    """Records every region read (index, rows, cols)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reads: list[tuple[int, tuple[int, int], tuple[int, int]]] = []

    def read(self, index: int, region: tuple[slice, slice]) -> torch.Tensor:
        self.reads.append((index, (region[0].start, region[0].stop), (region[1].start, region[1].stop)))
        return super().read(index, region)


def _model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 2, 3, 1, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 3)).double()


@pytest.mark.parametrize("which", [0, 1], ids=["spatial", "hybrid"])
def test_region_batches_read_only_this_ranks_block_and_train_as_full_tensors(comm, which):
    grid, samples = hybrid_layouts(comm.size)[which]
    g = torch.Generator().manual_seed(3)
    images = torch.randn(4 * samples, 3, 6 * comm.size + 1, 4 * comm.size + 3, dtype=torch.float64, generator=g)
    targets = torch.randint(0, 3, (4 * samples,), generator=g)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "images.npy"  # each rank's own copy of the same file (no shared directory)
        np.save(path, images.numpy())
        data = CountingRegions(path)
        batches = region_batches(data, targets, 2 * samples)
        torch.manual_seed(0)
        model = _model()
        ref = copy.deepcopy(model)
        fitted = fit(model, batches, nn.CrossEntropyLoss(), sgd, strategy="spatial", grid=grid, samples=samples,
                     progress=False)
        full = [(images[a:a + 2 * samples], targets[a:a + 2 * samples]) for a in range(0, len(targets), 2 * samples)]
        expected = fit(ref, full, nn.CrossEntropyLoss(), sgd, strategy="spatial", grid=grid, samples=samples,
                       progress=False)
    for (name, a), b in zip(fitted.model.state_dict().items(), expected.model.state_dict().values()):
        assert_close_all_ranks(comm, a.double(), b.double(), 0, 0, f"{name} after region vs full batches")
    dist = Distribution(comm, grid, samples)
    mine = []
    for batch, _ in batches:
        (n0, n1), rows, cols = dist.box(batch.shape)
        mine += [(batch.indices[i], rows, cols) for i in range(n0, n1)]
    assert_all_ranks(comm, data.reads == mine, f"reads {data.reads} != this rank's blocks {mine}")
    read = sum(3 * (r[1] - r[0]) * (c[1] - c[0]) for _, r, c in data.reads)
    total = comm.allreduce(torch.tensor([read], dtype=torch.float64), "sum")
    assert_all_ranks(comm, int(total.item()) == images.numel(), f"{int(total.item())} values read in all, "
                     f"the data set has {images.numel()}: no block is read twice")
