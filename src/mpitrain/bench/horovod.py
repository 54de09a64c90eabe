"""Horovod's synthetic benchmark on mpitrain: img/s of ``mpitrain.horovod.DistributedOptimizer`` vs
mpitrain's DataParallel vs torch DDP (gloo), same CNN and synthetic batch, interleaved in one job.

Run as ``mpitrain bench horovod -n 2 [--rounds 5] [--steps 6] [--batch 16]``. In the manner of Horovod's
``pytorch_synthetic_benchmark.py``: a fixed random batch per rank, SGD steps, img/s = batch x ranks /
step time. Each round times every contender for `steps` steps (median of the slowest rank's step), so
machine drift hits them alike; ratios are medians of per-round ratios. Two reference rows: ``alone``
(rank 0 trains while the others sleep) and ``local`` (every rank trains at once without communicating:
the ceiling of processes sharing this machine).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import mpitrain
import mpitrain.horovod as hvd
from mpitrain.bench.common import (
    alone_timer,
    header,
    median,
    paired_ratio,
    paired_rounds,
    print_table,
    quartiles,
    step_timer,
)
from mpitrain.bench.dataparallel import MODELS, _ddp
from mpitrain.strategies.data_parallel import DataParallel

__all__ = ["main"]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpitrain bench horovod", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cnn", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=0, help="per-rank batch (default: the model's in bench dataparallel)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6, help="timed steps per contender per round")
    p.add_argument("--no-ddp", action="store_true", help="skip torch DDP (e.g. without gloo)")
    return p.parse_args(argv)


def _stepper(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(1)
    comm = mpitrain.init()
    hvd.init()
    factory, shape, default_batch = MODELS[args.model]
    batch = args.batch or default_batch
    g = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def fresh() -> nn.Module:
        torch.manual_seed(0)
        return factory()

    plain = fresh()
    plain_step = _stepper(plain, torch.optim.SGD(plain.parameters(), lr=1e-4), x, y)
    hv = fresh()
    hvd_opt = hvd.DistributedOptimizer(torch.optim.SGD(hv.parameters(), lr=1e-4),
                                       named_parameters=hv.named_parameters())
    dp = DataParallel(fresh(), comm=comm)
    timers = {
        "alone": alone_timer(comm, plain_step if comm.rank == 0 else None, args.steps),
        "local": step_timer(comm, plain_step, args.steps),
        "hvd DistributedOptimizer": step_timer(comm, _stepper(hv, hvd_opt, x, y), args.steps),
        "DataParallel": step_timer(comm, _stepper(dp, torch.optim.SGD(dp.parameters(), lr=1e-4), x, y), args.steps),
    }
    if not args.no_ddp:
        ddp = _ddp(fresh(), 25.0)
        timers["DDP (gloo)"] = step_timer(comm, _stepper(ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4), x, y),
                                          args.steps)
    seconds = paired_rounds(timers, args.rounds)
    dp.close()
    if comm.rank == 0:
        print(header(f"Horovod-style synthetic benchmark ({args.model}, per-rank batch {batch}): img/s", comm.size))
        print(f"# {args.rounds} rounds x {args.steps} steps; img/s = batch x ranks / median step "
              f"(alone: batch / step); ratios: median of per-round ratios (q25-q75)")
        rows: list[list[object]] = []
        for name, secs in seconds.items():
            imgs = batch / median(secs) if name == "alone" else batch * comm.size / median(secs)
            hv_secs = seconds["hvd DistributedOptimizer"]
            vs = "-" if name == "hvd DistributedOptimizer" else \
                f"{paired_ratio(secs, hv_secs):.2f} ({quartiles([a / b for a, b in zip(secs, hv_secs)])})"
            rows.append([name, 1e3 * median(secs), imgs, vs])
        print_table(["contender", "ms/step", "img/s", "hvd speed-up over it"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
