"""``mpitrain bench dataparallel --device cuda``: ResNet-50 training steps on the GPU, milliseconds per
step of our DataParallel vs torch DDP over NCCL vs plain torch (no communication), fp32 and bf16
autocast, contenders interleaved round by round in one job (:func:`~.common.paired_rounds`).

Each rank trains on its own batch (default 64 x 3 x 224 x 224, 1000 classes) on the device
``mpitrain.init()`` bound it to. Ratios are per round, over plain torch in the same round. DDP runs only
where every rank has a GPU of its own (NCCL refuses two ranks on one device); ranks sharing a GPU time
DataParallel over the MPI backend (CUDA-aware or staged through host memory).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch import nn

import mpitrain
from mpitrain.bench.common import (
    device_line,
    device_timer,
    header,
    ms_against,
    paired_rounds,
    print_table,
)
from mpitrain.strategies.data_parallel import DataParallel

__all__ = ["run"]


def _resnet50() -> nn.Module:
    from mpitrain.spatial.models import torchvision_module

    return torchvision_module("models.resnet").resnet50(num_classes=1000)  # type: ignore[no-any-return]


class _Step:
    """zero_grad, forward (bf16 autocast if asked), backward, SGD step, on fixed device batches."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> None:
        self.model, self.x, self.y, self.bf16 = model, x, y, bf16
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    def __call__(self) -> None:
        self.opt.zero_grad()
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with ctx:
            loss = F.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()


def _ddp(model: nn.Module, dev: torch.device, bucket_mb: float) -> nn.Module:
    import torch.distributed as dist

    from mpitrain.comm._torchdist import init_torch_world

    if not dist.is_initialized():
        init_torch_world(mpitrain.rank(), mpitrain.size(), mpitrain.init())
    return nn.parallel.DistributedDataParallel(model, device_ids=[dev.index], bucket_cap_mb=bucket_mb)


def run(args: argparse.Namespace) -> list[list[object]]:
    """Time every contender (see the module doc); rank 0 prints the table. Collective."""
    comm = mpitrain.init()
    dev = mpitrain.device()
    torch.backends.cudnn.benchmark = True
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(args.batch, 3, args.image, args.image, generator=g).to(dev)
    y = torch.randint(0, 1000, (args.batch,), generator=g).to(dev)
    own_gpu = torch.cuda.device_count() >= comm.size
    rows: list[list[object]] = []
    for precision in args.precisions:
        bf16 = precision == "bf16"
        torch.manual_seed(0)
        plain = _resnet50().to(dev)
        timers = {"plain torch": device_timer(comm, _Step(plain, x, y, bf16), args.steps, dev)}
        if own_gpu and not args.no_ddp:
            torch.manual_seed(0)
            ddp = _ddp(_resnet50().to(dev), dev, args.bucket_mb)
            timers["ddp (nccl)"] = device_timer(comm, _Step(ddp, x, y, bf16), args.steps, dev)
        dps = []
        for kv in args.kvstores.split(","):
            torch.manual_seed(0)
            dp = DataParallel(_resnet50().to(dev), kvstore=kv, bucket_mb=args.bucket_mb, comm=comm)
            dps.append(dp)
            timers[f"mpitrain/{kv}"] = device_timer(comm, _Step(dp, x, y, bf16), args.steps, dev)
        t = paired_rounds(timers, args.rounds)
        for name, v in t.items():
            rows.append([precision, name, *ms_against(v, t["plain torch"])])
        for dp in dps:
            dp.close()
        del plain, dps, timers
        torch.cuda.empty_cache()
    if comm.rank == 0:
        print(header("DataParallel on CUDA: ms/step vs torch DDP (NCCL) vs plain torch, interleaved rounds",
                     comm.size))
        print(device_line(comm, dev))
        print(f"# ResNet-50, per-rank batch {args.batch} x 3 x {args.image}^2; {args.rounds} rounds x {args.steps} "
              f"steps; bucket {args.bucket_mb} MiB")
        print_table(["precision", "contender", "ms/step", "min", "max", "vs plain", "q25-q75"], rows)
    return rows

