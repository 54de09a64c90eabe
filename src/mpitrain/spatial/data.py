"""Spatial input without loading whole samples: each rank reads only its block of each of its samples.

A dataset that can read a region of one sample implements :class:`RegionDataset`
(``sample_shape`` and ``read(index, region)``); :class:`NpyRegions` does it for a ``.npy`` array of
samples through a read-only memory map, so only the pages of the region are touched. Batches of such a
dataset are :class:`RegionBatch` objects (a dataset and sample indices, no pixels): give
``fit(strategy="spatial")`` an iterable of ``(RegionBatch, targets)`` (e.g. :func:`region_batches`) and
every rank reads its own sample group's samples, only its grid block of each (:func:`read_block`).

For ``fit(dataset, batch_size=...)`` a map-style Dataset is read by region when it also implements
:class:`RegionDataset` and ``target(index)`` (:class:`RegionSamples` joins a RegionDataset and its
targets): each rank's DataLoader then reads ``(read(index, its region), target(index))`` through
:class:`BlockReader`. Any other Dataset is read whole per sample and cropped to the rank's block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import Dataset

from .distribution import Distribution, ranges
from .tensor import Layout, SpatialError, SpatialTensor, tag

__all__ = ["RegionDataset", "NpyRegions", "RegionBatch", "RegionSamples", "BlockReader", "region_batches",
           "read_block", "region_of", "reads_regions", "dense_target_shape"]


@runtime_checkable
class RegionDataset(Protocol):
    """Samples that can be read by region: ``sample_shape`` is (C, H, W); ``read(index, region)``
    returns the (C, h, w) tensor of sample `index` at ``region = (rows, cols)`` (two slices with
    step 1, within the sample)."""

    @property
    def sample_shape(self) -> tuple[int, ...]: ...

    def read(self, index: int, region: tuple[slice, slice]) -> torch.Tensor: ...


class NpyRegions:
    """A ``.npy`` file holding an (N, C, H, W) array — or (N, H, W), e.g. dense label maps — memory-mapped
    read-only: :meth:`read` copies only the region (the rows of the region's columns), so a rank touches
    no other block's pixels."""

    def __init__(self, path: str | Path) -> None:
        self.array = np.load(path, mmap_mode="r")
        if self.array.ndim not in (3, 4):
            raise SpatialError(f"{path}: expected an (N, C, H, W) or (N, H, W) array, got shape {self.array.shape}")

    def __len__(self) -> int:
        return int(self.array.shape[0])

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.array.shape[1:])

    def read(self, index: int, region: tuple[slice, slice]) -> torch.Tensor:
        return torch.from_numpy(np.array(self.array[(index, ..., *region)], copy=True, order="C"))


@dataclass(frozen=True, repr=False)
class RegionBatch:
    """A global mini-batch named by sample indices of a :class:`RegionDataset` (no pixels loaded). Its
    repr names the dataset's type and sample shape and the indices, the same on every rank holding the
    same batch (``fit`` checksums the first batch of each epoch across ranks)."""

    dataset: RegionDataset
    indices: tuple[int, ...]

    def __repr__(self) -> str:
        return f"RegionBatch({type(self.dataset).__name__}{self.dataset.sample_shape}, indices={self.indices})"

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.indices), *self.dataset.sample_shape)

    def __len__(self) -> int:
        return len(self.indices)


def region_batches(dataset: RegionDataset, targets: torch.Tensor, batch_size: int
                   ) -> list[tuple[RegionBatch, torch.Tensor]]:
    """``(RegionBatch, targets)`` of consecutive samples (the last batch may be smaller), for ``fit``
    (a list: it can be iterated once per epoch; it holds indices, not pixels)."""
    n = len(targets)
    return [(RegionBatch(dataset, tuple(range(a, min(n, a + batch_size)))), targets[a:a + batch_size])
            for a in range(0, n, batch_size)]


class RegionSamples(Dataset[tuple[torch.Tensor, object]]):
    """A map-style Dataset of ``(sample, target)`` over a :class:`RegionDataset` and its targets, that
    can also be read by region (``read``, ``target``): ``fit(strategy="spatial")`` reads only each rank's
    block of each sample; any other strategy (or one process) reads ``dataset[i]``, the whole sample.

    Dense targets — a :class:`RegionDataset` of the samples' extent (``NpyRegions("labels.npy")`` of
    N x H x W label maps), or a tensor whose trailing dims are the samples' H x W — are read by region
    too (:meth:`read_target`): the rank gets only its block of each target, laid out like the output."""

    def __init__(self, regions: RegionDataset, targets: torch.Tensor | Sequence[object] | RegionDataset) -> None:
        if len(targets) != len(regions):  # type: ignore[arg-type]
            raise SpatialError(f"{len(targets)} targets for {len(regions)} samples")  # type: ignore[arg-type]
        self.regions, self.targets = regions, targets
        k = len(regions.sample_shape) - 1
        if isinstance(targets, RegionDataset):
            shape: tuple[int, ...] | None = tuple(targets.sample_shape)
        else:
            shape = tuple(targets.shape[1:]) if isinstance(targets, torch.Tensor) else None
        dense = shape is not None and len(shape) >= k and shape[len(shape) - k:] == tuple(regions.sample_shape[1:])
        if isinstance(targets, RegionDataset) and not dense:
            raise SpatialError(f"targets read by region must have the samples' extent "
                               f"{tuple(regions.sample_shape[1:])}, got sample shape {shape}")
        #: one target's shape when the targets are dense (read by region), else None
        self.target_shape = shape if dense else None

    def __len__(self) -> int:
        return len(self.targets)  # type: ignore[arg-type]

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return self.regions.sample_shape

    def read(self, index: int, region: tuple[slice, ...]) -> torch.Tensor:
        return self.regions.read(index, region)  # type: ignore[arg-type]

    def target(self, index: int) -> object:
        """The whole target of sample `index`."""
        if isinstance(self.targets, RegionDataset):
            return self.targets.read(index, tuple(slice(0, n) for n in self.sample_shape[1:]))  # type: ignore[arg-type]
        return self.targets[index]

    def read_target(self, index: int, region: tuple[slice, ...]) -> object:
        """The target of sample `index` at `region` when the targets are dense, else the whole target."""
        if self.target_shape is None:
            return self.target(index)
        if isinstance(self.targets, RegionDataset):
            return self.targets.read(index, region)  # type: ignore[arg-type]
        return self.targets[index][(..., *region)]  # type: ignore[index]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, object]:
        whole = tuple(slice(0, n) for n in self.sample_shape[1:])
        return self.read(index, whole), self.target(index)


def dense_target_shape(dataset: object) -> tuple[int, ...] | None:
    """One target's shape when `dataset` reads its targets by region (:meth:`RegionSamples.read_target`),
    else None."""
    shape = getattr(dataset, "target_shape", None)
    return tuple(shape) if shape is not None and callable(getattr(dataset, "read_target", None)) else None


def reads_regions(dataset: object) -> bool:
    """Whether `dataset` can be read by region for fit: a :class:`RegionDataset` with ``target(index)``."""
    return isinstance(dataset, RegionDataset) and callable(getattr(dataset, "target", None))


def region_of(dist: Distribution, sample_shape: tuple[int, ...]) -> tuple[slice, ...]:
    """This rank's region (one slice per grid dimension) of a sample of `sample_shape` (C, H, W)."""
    if len(sample_shape) != len(dist.grid) + 1:
        raise SpatialError(f"samples of shape {tuple(sample_shape)} do not match grid {dist.grid}")
    return tuple(slice(*ranges(n, g)[c]) for n, g, c in zip(sample_shape[1:], dist.grid, dist.coords))


class BlockReader(Dataset[tuple[torch.Tensor, object]]):
    """The Dataset a spatial rank's DataLoader reads (fit's ``rank_view``): item ``i`` is ``(block, target)``
    with the block of sample i at this rank's `region` only. Holds no communicator, so DataLoader worker
    processes can take it."""

    def __init__(self, dataset: RegionDataset, region: tuple[slice, ...]) -> None:
        self.dataset, self.region = dataset, region

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, object]:
        block = self.dataset.read(index, self.region)  # type: ignore[arg-type]
        if dense_target_shape(self.dataset) is not None:  # dense targets: this block's too
            return block, self.dataset.read_target(index, self.region)  # type: ignore[attr-defined]
        return block, self.dataset.target(index)  # type: ignore[attr-defined]


def read_block(batch: RegionBatch, dist: Distribution, dtype: torch.dtype | None = None) -> SpatialTensor:
    """This rank's block of `batch`: its sample group's samples, each read only at this rank's grid
    block (one ``read`` per sample). Local: no message. Every rank must hold the same batch."""
    shape = batch.shape
    dist.check_shape(shape, "region batch")
    if len(shape) != 4:
        raise SpatialError(f"region batches are NCHW; got samples of shape {shape[1:]}")
    (n0, n1), (h0, h1), (w0, w1) = dist.box(shape)
    parts: Sequence[torch.Tensor] = [batch.dataset.read(batch.indices[i], (slice(h0, h1), slice(w0, w1)))
                                     for i in range(n0, n1)]
    block = torch.stack(list(parts))
    if tuple(block.shape) != (n1 - n0, shape[1], h1 - h0, w1 - w0):
        raise SpatialError(f"read returned blocks of shape {tuple(block.shape[1:])}, expected "
                           f"{(shape[1], h1 - h0, w1 - w0)}")
    if dtype is not None:
        block = block.to(dtype)
    return tag(block, Layout(dist, "block", shape))
