"""Spatial input read by region: every rank reads only its own block of its own samples from a .npy
memory map, and fit(strategy="spatial") on such batches trains exactly as on full tensors; dense targets
(label maps of the samples' extent) are read by region too."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mpitrain.fit import fit
from mpitrain.spatial import BlockReader, Distribution, NpyRegions, RegionSamples, SpatialError, region_batches
from mpitrain.spatial.data import dense_target_shape
from tests.helpers import assert_all_ranks, assert_close_all_ranks
from tests.spatial.test_trainer import hybrid_layouts, sgd


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


@pytest.mark.mpi
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


def test_dense_targets_are_read_by_region_and_class_labels_whole(tmp_path):
    images = torch.randn(3, 2, 6, 5, dtype=torch.float64)
    labels = torch.randint(0, 4, (3, 6, 5))
    np.save(tmp_path / "images.npy", images.numpy())
    np.save(tmp_path / "labels.npy", labels.numpy())
    region = (slice(2, 5), slice(1, 3))
    for targets in (CountingRegions(tmp_path / "labels.npy"), labels):  # a label-map RegionDataset, a tensor
        data = RegionSamples(NpyRegions(tmp_path / "images.npy"), targets)
        assert dense_target_shape(data) == (6, 5)
        block, target = BlockReader(data, region)[1]
        assert torch.equal(block, images[1][:, 2:5, 1:3]) and torch.equal(torch.as_tensor(target), labels[1][2:5, 1:3])
        assert torch.equal(torch.as_tensor(data[1][1]), labels[1])  # one process / other strategies: whole
    assert targets is labels and data.targets is labels
    classes = RegionSamples(NpyRegions(tmp_path / "images.npy"), torch.tensor([0, 2, 1]))
    assert dense_target_shape(classes) is None and BlockReader(classes, region)[2][1] == 1
    np.save(tmp_path / "coarse.npy", labels[:, ::2].numpy())  # label maps of another extent: not readable alike
    with pytest.raises(SpatialError, match="samples' extent"):
        RegionSamples(NpyRegions(tmp_path / "images.npy"), NpyRegions(tmp_path / "coarse.npy"))
