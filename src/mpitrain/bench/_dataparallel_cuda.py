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
from collections import Counter

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
from mpitrain.comm.base import Communicator
from mpitrain.strategies.data_parallel import DataParallel

__all__ = ["run", "resnet50"]


def resnet50() -> nn.Module:
    """torchvision's ResNet-50, 1000 classes, random weights (its C++ ops never loaded: tests/README.md)."""
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
        with torch.profiler.record_function(_BACKWARD):  # a no-op unless a profiler runs (--trace)
            loss.backward()
        self.opt.step()


def _ddp(model: nn.Module, dev: torch.device, bucket_mb: float) -> nn.Module:
    import torch.distributed as dist

    from mpitrain.comm import init_torch_world

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
        plain = resnet50().to(dev)
        timers = {"plain torch": device_timer(comm, _Step(plain, x, y, bf16), args.steps, dev)}
        if own_gpu and not args.no_ddp:
            torch.manual_seed(0)
            ddp = _ddp(resnet50().to(dev), dev, args.bucket_mb)
            timers["ddp (nccl)"] = device_timer(comm, _Step(ddp, x, y, bf16), args.steps, dev)
        dps = []
        for kv in args.kvstores.split(","):
            torch.manual_seed(0)
            dp = DataParallel(resnet50().to(dev), kvstore=kv, bucket_mb=args.bucket_mb, comm=comm)
            dps.append(dp)
            timers[f"mpitrain/{kv}"] = device_timer(comm, _Step(dp, x, y, bf16), args.steps, dev)
        t = paired_rounds(timers, args.rounds)
        if args.trace and dps:
            waits = _trace(comm, _Step(dps[0], x, y, bf16), args.trace, precision)
            if comm.rank == 0:
                print_table(["precision", "rank", "backward ms", "kernel launches", "waits (n / ms): launching thread",
                             "other threads"], waits)
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


_BACKWARD = "mpitrain.bench.backward"
#: CUDA runtime calls that block the calling host thread until the GPU gets somewhere
_HOST_WAITS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"})


def _trace(comm: Communicator, step: _Step, out_dir: str, precision: str) -> list[list[object]]:
    """Profile two steps of `step` on every rank (a Chrome trace per rank in `out_dir`) and count the
    CUDA runtime calls that block a host thread during backward. Autograd launches a CUDA backward's
    kernels from its own device thread (the thread with the most launches in the window) and runs
    DataParallel's gradient hooks there: a wait per bucket on that thread would stall the launches (the
    overlap's promise is that only the comm threads wait, for their side streams). Collective; returns
    every rank's row."""
    import json
    import os

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    path = os.path.join(out_dir, f"dataparallel-{precision}-rank{comm.rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("name") == _BACKWARD and e.get("cat") == "user_annotation"]
    during = [e for e in events if e.get("cat") == "cuda_runtime" and any(a <= e["ts"] <= b for a, b in windows)]
    launches = Counter(e["tid"] for e in during if e.get("name", "").startswith("cudaLaunchKernel"))
    launcher = launches.most_common(1)[0][0] if launches else None
    waits = [e for e in during if e.get("name") in _HOST_WAITS]
    mine = [e for e in waits if e["tid"] == launcher]
    others = [e for e in waits if e["tid"] != launcher]
    row = [precision, comm.rank, round(sum(b - a for a, b in windows) / 1e3 / max(len(windows), 1), 2),
           launches.get(launcher, 0), f"{len(mine)} / {sum(e['dur'] for e in mine) / 1e3:.2f}",
           f"{len(others)} / {sum(e['dur'] for e in others) / 1e3:.2f}"]
    return list(comm.allgather_object(row))
