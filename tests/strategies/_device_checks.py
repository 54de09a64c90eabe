"""Data-parallel runs parameterised by device and communicator, shared by the CPU tests (over the MPI
backend's host-staging path, forced) and the CUDA tests (tests/gpu): the same training through two
paths must end with bitwise equal parameters, and both within float32 rounding of one process."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mpitrain import kvstore as kvmod
from mpitrain.fit import fit
from mpitrain.strategies.data_parallel import DataParallel
from tests.helpers import assert_all_ranks, assert_close_all_ranks

PER_RANK = 4
STEPS = 3
ATOL = 1e-5
SMALL = {"bucket_mb": 0.0005, "first_bucket_mb": 0.00003}  # several buckets for the tiny CNN


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.conv(x)).flatten(1))


def fresh_model(device: torch.device) -> nn.Module:
    torch.manual_seed(1234)
    return TinyCNN().to(device)


def global_batches(size: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """CPU batches of ``size * PER_RANK`` rows (DataParallel moves each rank's slice to the model)."""
    g = torch.Generator().manual_seed(0)
    n = size * PER_RANK
    return [(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)) for _ in range(steps)]


def train_data_parallel(comm, kvstore: str, device: torch.device) -> list[torch.Tensor]:
    """STEPS SGD steps of DataParallel over `comm`; each rank's batch slice arrives on the CPU.
    dist_sync_mpi runs without fusion: which buckets fuse depends on timing, and MPI may sum a fused
    buffer in another order than a lone one (equal within rounding, not bitwise)."""
    model = fresh_model(device)
    store = kvmod.create(kvstore, comm=comm, fusion_bytes=0) if kvstore == "dist_sync_mpi" else kvstore
    dp = DataParallel(model, kvstore=store, comm=comm, **SMALL)
    assert_all_ranks(comm, all(b.buffer.device == model_device_of(model) for b in dp.buckets),
                     "buckets must live on the model's device")
    opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    for x, y in global_batches(comm.size):
        rows = slice(comm.rank * PER_RANK, (comm.rank + 1) * PER_RANK)
        opt.zero_grad()
        out = dp(x[rows])  # moved to the model's device by DataParallel
        F.cross_entropy(out, y[rows].to(out.device)).backward()
        opt.step()
    dp.close()
    if not isinstance(store, str):
        store.close()
    return [p.detach().cpu() for p in model.parameters()]


def train_fit(comm, device: torch.device, precision: str = "fp32") -> list[torch.Tensor]:
    """fit(strategy="data", kvstore="depchain": a fixed reduction order) with CPU batches and a model on
    `device`."""
    model = fresh_model(device)
    fit(model, global_batches(comm.size), F.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        strategy="data", comm=comm, progress=False, precision=precision, bucket_mb=0.0005, kvstore="depchain")
    return [p.detach().cpu() for p in model.parameters()]


def steps_in_one_process(model: nn.Module, batches, loss_fn, opt: torch.optim.Optimizer, device: torch.device,
                         precision: str = "fp32") -> list[torch.Tensor]:
    """The reference every check compares with: plain torch steps on whole batches moved to `device`,
    forward and loss under bf16 autocast for precision "bf16"; the parameters after, on the CPU."""
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def train_one_process(size: int, device: torch.device, precision: str = "fp32") -> list[torch.Tensor]:
    """The reference: the same steps on the concatenated batch in this process."""
    model = fresh_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return steps_in_one_process(model, global_batches(size), F.cross_entropy, opt, device, precision)


def model_device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def assert_bitwise(comm, a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert_all_ranks(comm, len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b)),
                     f"{what}: parameters differ")


def assert_one_process(comm, got: list[torch.Tensor], ref: list[torch.Tensor], what: str, atol: float = ATOL) -> None:
    for i, (p, q) in enumerate(zip(got, ref)):
        assert_close_all_ranks(comm, p, q, atol=atol, what=f"{what}: parameter {i}")


def train_pipe_sgd_sync(comm, device: torch.device, precision: str = "fp32") -> list[torch.Tensor]:
    """fit(strategy="pipe-sgd", staleness=1): synchronous SGD, so the one-process steps are its reference."""
    model = fresh_model(device)
    fit(model, global_batches(comm.size), F.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        strategy="pipe-sgd", comm=comm, progress=False, staleness=1, precision=precision)
    return [p.detach().cpu() for p in model.parameters()]


def mlp(device: torch.device) -> nn.Module:
    torch.manual_seed(4321)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 10)).to(device)


def pipeline_layouts(size: int) -> list[tuple[str, int]]:
    """(strategy, partitions) to check at `size` ranks: the model over every rank, and hybrid where
    two partitions divide the ranks."""
    out = [("model", size)]
    if size % 2 == 0 and size > 2:
        out.append(("hybrid", 2))
    return out


def train_pipeline(comm, device: torch.device, strategy: str, partitions: int,
                   precision: str = "fp32") -> list[torch.Tensor]:
    """fit(strategy="model"/"hybrid") of the MLP on `device`, CPU batches; parameters on the CPU."""
    result = fit(mlp(device), global_batches(comm.size), F.cross_entropy,
                 lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), strategy=strategy, partitions=partitions,
                 micro_batches=2, progress=False, balance="params", comm=comm, precision=precision)
    return [p.detach().cpu() for p in result.model.parameters()]


def train_pipeline_one_process(size: int, device: torch.device, precision: str = "fp32") -> list[torch.Tensor]:
    model = mlp(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return steps_in_one_process(model, global_batches(size), F.cross_entropy, opt, device, precision)


def thin_cnn() -> nn.Module:
    """Two 3x3 convolutions (BatchNorm, in-place ReLU), a global pool and a linear head: on images one
    row per rank high, each rank's halo of the second convolution is its whole block, a view of an
    activation that requires grad (what ResNet-18's last stage sends at 64^2 on 2 ranks)."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                         nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, 3))


def train_spatial(comm, device: torch.device, precision: str = "fp32",
                  thin: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fit(strategy="spatial") of a small mesh model (with `thin`: :func:`thin_cnn` on images one row
    per rank high) on `device` over a (size x 1) grid, and the same steps in one process; both
    parameter lists on the CPU."""
    from mpitrain.spatial.mesh import mesh_batch, mesh_model

    def build() -> nn.Module:
        torch.manual_seed(0)
        return (thin_cnn() if thin else mesh_model(in_channels=3, widths=(4, 6), convs_per_block=1)).to(device)

    model, ref = build(), build()
    if thin:
        g = torch.Generator().manual_seed(3)
        data = [(torch.randn(2, 3, comm.size, 5, generator=g), torch.randint(0, 3, (2,), generator=g))
                for _ in range(2)]
    else:
        data = [mesh_batch(2, 24, in_channels=3, blocks=2, seed=s) for s in range(2)]
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    result = fit(model, data, nn.CrossEntropyLoss(), sgd, strategy="spatial", grid=(comm.size, 1), samples=1,
                 progress=False, comm=comm, precision=precision)
    want = steps_in_one_process(ref, data, nn.CrossEntropyLoss(), sgd(ref.parameters()), device, precision)
    return [p.detach().cpu() for p in result.model.parameters()], want
