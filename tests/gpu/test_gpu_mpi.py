"""Several ranks sharing the GPUs of one machine through the MPI backend (CUDA-aware MPI directly, else
host staging: NCCL refuses two ranks on one device). Collectives on CUDA tensors against the same calls
on CPU tensors, and data-parallel training of a CUDA model against one process. Skipped, saying why,
where torch sees no GPU."""

from __future__ import annotations

import pytest
import torch

from mpitrain.comm import DTYPES, split_sizes
from mpitrain.comm.compose import direct_devices, mpi_communicator
from tests.gpu._cuda import needs_cuda
from tests.helpers import assert_all_ranks
from tests.strategies import _device_checks as dc

pytestmark = [pytest.mark.mpi, *needs_cuda]

#: the floating and 32/64-bit integer dtypes, with every op they take (all other dtypes: test_dtypes.py)
COMMON = DTYPES[:6]


def data(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + n)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 3
    return x.to(dtype) if dtype.is_floating_point else x.round().to(dtype)


def same(comm, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise where MPI reduces on the host for both (staging); within rounding for CUDA-aware MPI,
    which may sum device buffers in another order."""
    staged = comm.backend == "mpi" and "cuda" not in direct_devices(comm)
    got = got.cpu()
    ok = got.shape == want.shape and got.dtype == want.dtype and (
        torch.equal(got, want) if staged or not want.is_floating_point()
        else torch.allclose(got.double(), want.double(), rtol=1e-2 if want.itemsize == 2 else 1e-6, atol=1e-6))
    assert_all_ranks(comm, ok, f"{what}: cuda result differs from the cpu one")


@pytest.mark.parametrize("dtype", COMMON, ids=str)
def test_cuda_collectives_equal_the_cpu_ones(comm, device, dtype):
    r, p = comm.rank, comm.size
    for op in ("sum", "avg", "max", "min", "prod"):
        if op == "avg" and not dtype.is_floating_point:
            continue
        want = comm.allreduce(data(r, 1000, dtype), op)
        same(comm, comm.allreduce(data(r, 1000, dtype).to(device), op), want, f"allreduce {op}")
        # against the CPU's iallreduce: Open MPI's nonblocking reduction may sum in another order
        want = comm.iallreduce(data(r, 1000, dtype), op).wait()
        same(comm, comm.iallreduce(data(r, 1000, dtype).to(device), op).wait(), want, f"iallreduce {op}")
    for root in range(p):
        same(comm, comm.broadcast(data(r, 9, dtype).to(device), root), data(root, 9, dtype), f"broadcast {root}")
    same(comm, comm.allgather(data(r, 7, dtype).to(device)), comm.allgather(data(r, 7, dtype)), "allgather")
    x = data(r, 2 * p + 1, dtype)
    same(comm, comm.reduce_scatter(x.to(device)), comm.reduce_scatter(x.clone()), "reduce_scatter")
    sc, rc = split_sizes(5 + r, p), [split_sizes(5 + q, p)[r] for q in range(p)]
    x = data(r, 5 + r, dtype).reshape(-1, 1)
    same(comm, comm.alltoallv(x.to(device), sc, rc), comm.alltoallv(x, sc, rc), "alltoallv")
    right, left = (r + 1) % p, (r - 1) % p
    got = torch.zeros(11, dtype=dtype, device=device)
    comm.sendrecv(data(r, 11, dtype).to(device), right, got, left)
    same(comm, got, data(left, 11, dtype), "sendrecv")
    got = torch.zeros(11, dtype=dtype, device=device)
    reqs = [comm.irecv(got, left, 2), comm.isend(data(r, 11, dtype).to(device), right, 2)]
    for q in reqs:
        q.wait()
    same(comm, got, data(left, 11, dtype), "isend/irecv")


def test_large_cuda_allreduce_and_broadcast_go_piece_by_piece_and_equal_the_cpu_ones(comm, device):
    """Above SPLIT_ABOVE a staged tensor is copied and reduced piece by piece (copies overlapping MPI)."""
    from mpitrain.comm._mpi import SPLIT_ABOVE

    r, n = comm.rank, SPLIT_ABOVE // 4 + 5
    for op in ("sum", "avg"):
        want = comm.allreduce(data(r, n, torch.float32), op)
        same(comm, comm.allreduce(data(r, n, torch.float32).to(device), op), want, f"large allreduce {op}")
    same(comm, comm.broadcast(data(r, n, torch.float32).to(device), 0), data(0, n, torch.float32), "large broadcast")


@pytest.mark.parametrize("kvstore", ["dist_sync_mpi", "depchain", "funnel", "concurrent"])
def test_data_parallel_of_a_cuda_model_equals_one_process(comm, device, kvstore):
    got = dc.train_data_parallel(comm, kvstore, device)
    dc.assert_one_process(comm, got, dc.train_one_process(comm.size, device), f"{kvstore} on {device}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fit_data_of_a_cuda_model_equals_one_process(comm, device, precision):
    got = dc.train_fit(comm, device, precision)
    ref = dc.train_one_process(comm.size, device, precision)
    dc.assert_one_process(comm, got, ref, f"fit {precision} on {device}", atol=dc.ATOL if precision == "fp32" else 1e-2)


def test_staged_data_parallel_of_a_cuda_model_is_bitwise_the_default_path(comm, device):
    if comm.backend != "mpi":
        pytest.skip("host staging is the MPI backend's path")
    staged = mpi_communicator(comm.mpi_comm, direct=frozenset({"cpu"}))
    got = dc.train_data_parallel(staged, "depchain", device)
    ref = dc.train_data_parallel(comm, "depchain", device)
    if "cuda" in direct_devices(comm):  # CUDA-aware MPI may sum in another order
        dc.assert_one_process(comm, got, ref, "staged vs CUDA-aware", atol=1e-6)
    else:
        dc.assert_bitwise(comm, got, ref, "staged vs default (staged too)")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_synchronous_pipe_sgd_of_a_cuda_model_equals_one_process(comm, device, precision):
    got = dc.train_pipe_sgd_sync(comm, device, precision)
    dc.assert_one_process(comm, got, dc.train_one_process(comm.size, device, precision),
                          f"pipe-sgd K=1 {precision} on {device}", atol=dc.ATOL if precision == "fp32" else 1e-2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_and_hybrid_fit_of_a_cuda_model_equal_one_process(comm, device, precision):
    ref = dc.train_pipeline_one_process(comm.size, device, precision)
    atol = dc.ATOL if precision == "fp32" else 1e-2
    for strategy, parts in dc.pipeline_layouts(comm.size):
        got = dc.train_pipeline(comm, device, strategy, parts, precision)
        dc.assert_one_process(comm, got, ref, f"{strategy} P={parts} {precision} on {device}", atol=atol)


@pytest.mark.parametrize("thin", [False, True], ids=["mesh", "whole-block-halos"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_spatial_fit_of_a_cuda_model_equals_one_process(comm, device, precision, thin):
    got, ref = dc.train_spatial(comm, device, precision, thin=thin)
    dc.assert_one_process(comm, got, ref, f"spatial {precision} on {device}",
                          atol=dc.ATOL if precision == "fp32" else 1e-2)


def test_spatial_fit_on_region_batches_moves_blocks_to_the_cuda_model(comm, device, tmp_path_factory):
    """A RegionBatch's blocks are read on the CPU and moved to the model's device: training on them
    equals training on the same images as full tensors (both on the GPU, float64)."""
    import copy

    import numpy as np
    from torch import nn

    from mpitrain.fit import fit
    from mpitrain.spatial import NpyRegions, region_batches

    g = torch.Generator().manual_seed(3)
    images = torch.randn(4, 3, 6 * comm.size + 1, 9, dtype=torch.float64, generator=g)
    targets = torch.randint(0, 3, (4,), generator=g)
    path = tmp_path_factory.mktemp(f"rank{comm.rank}") / "images.npy"  # each rank's own copy
    np.save(path, images.numpy())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3, 1, 1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 3)).double().to(device)
    ref = copy.deepcopy(model)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    opts = dict(strategy="spatial", grid=(comm.size, 1), samples=1, progress=False, comm=comm)
    got = fit(model, region_batches(NpyRegions(path), targets, 2), nn.CrossEntropyLoss(), sgd, **opts)
    want = fit(ref, [(images[a:a + 2], targets[a:a + 2]) for a in (0, 2)], nn.CrossEntropyLoss(), sgd, **opts)
    got_p = [p.detach().cpu() for p in got.model.parameters()]
    dc.assert_one_process(comm, got_p, [p.detach().cpu() for p in want.model.parameters()], "region vs full on cuda",
                          atol=1e-12)


@pytest.mark.mpi(sizes=(2,))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_spatial_fit_of_torchvision_resnet18_on_cuda_equals_one_process_without_hanging(comm, device, dtype):
    """The case that hung on an H200 (issue #30): fit(strategy="spatial") of ResNet-18 at 64^2 on grids
    2x1 and 1x2 of ranks sharing the GPU. Its last stage is 2x2, so each rank's halo there is its whole
    block. A stall now ends the job after 60 s, naming the exchange and the ranks."""
    import copy

    from torch import nn

    from mpitrain.fit import fit
    from mpitrain.spatial.models import torchvision_module

    torch.manual_seed(0)
    model = torchvision_module("models.resnet").resnet18(num_classes=10).to(dtype).to(device)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 3, 64, 64, dtype=dtype, generator=g), torch.randint(0, 10, (2,), generator=g))
            for _ in range(2)]
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    ref = copy.deepcopy(model)
    want = dc.steps_in_one_process(ref, data, nn.CrossEntropyLoss(), sgd(ref.parameters()), device)
    for grid in ((2, 1), (1, 2)):
        got = fit(copy.deepcopy(model), data, nn.CrossEntropyLoss(), sgd, strategy="spatial", grid=grid, samples=1,
                  progress=False, comm=comm, warn_after=20.0, abort_after=60.0).model
        dc.assert_one_process(comm, [p.detach().cpu() for p in got.parameters()], want, f"resnet18 {grid} {dtype}",
                              atol=1e-9 if dtype == torch.float64 else 1e-3)
