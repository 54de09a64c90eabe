"""Spatial parallelism (Dryden et al.): each sample's height and width split over ranks, exact layers."""

from __future__ import annotations

from ._reduce import GradBucket, allreduce_sum
from .batchnorm import SpatialBatchNorm2d, SpatialBatchNorm3d
from .conv import SpatialConv2d
from .data import BlockReader, NpyRegions, RegionBatch, RegionDataset, RegionSamples, read_block, region_batches
from .distribution import Distribution, gather, gather_group
from .halo import HaloPlan, Window, halo_exchange, plan_grid, plan_halo, window_of
from .loss import DENSE_LOSSES
from .parallelize import SpatialParallel, SpatialSequential, parallelize
from .pooling import SpatialAdaptiveAvgPool2d, SpatialAvgPool2d, SpatialMaxPool2d
from .redistribute import Redistribute, redistribute
from .resample import SpatialConvTranspose2d, SpatialUpsample, interpolate
from .tensor import Layout, SpatialError, SpatialTensor, layout_of
from .volume import SpatialAvgPool3d, SpatialConv3d, SpatialMaxPool3d

__all__ = [
    "Distribution", "Layout", "SpatialTensor", "SpatialError", "gather", "gather_group", "layout_of",
    "HaloPlan", "Window", "halo_exchange", "plan_grid", "plan_halo", "window_of",
    "SpatialConv2d", "SpatialMaxPool2d", "SpatialAvgPool2d", "SpatialAdaptiveAvgPool2d", "SpatialBatchNorm2d",
    "SpatialConv3d", "SpatialMaxPool3d", "SpatialAvgPool3d", "SpatialBatchNorm3d",
    "SpatialConvTranspose2d", "SpatialUpsample", "interpolate",
    "parallelize", "SpatialParallel", "SpatialSequential", "Redistribute", "redistribute",
    "allreduce_sum", "GradBucket", "DENSE_LOSSES",
    "RegionDataset", "NpyRegions", "RegionBatch", "RegionSamples", "BlockReader", "region_batches", "read_block",
]
