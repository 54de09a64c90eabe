"""Spatial strong scaling (Table I shape): time per training step and step memory per rank, spatial
vs one process. ``mpitrain bench spatial -n 2`` (and ``-n 4``); ``--baseline`` (implied on one rank)
times plain torch on rank 0 alone, the others asleep, in every memory format of ``--formats``.

``--model``: ``mesh`` (the paper's mesh-tangling model, default), ``resnet50`` (torchvision's, 10
classes, the paper's other network), ``unet`` (:class:`~mpitrain.spatial.models.UNet`, per-pixel
classes), ``cosmoflow`` (:func:`~mpitrain.spatial.models.cosmoflow`, ``--size`` cubes, a 3-D grid
``--grids 2x1x1``, MSE regression of 4 parameters). ``vs ceiling`` is the spatial row's speed as a
fraction of its ``--ceiling`` row's.

Memory formats: oneDNN convolutions run several times faster channels-last on CPU, so the strongest
single process is the channels-last one; every row names its format and is compared with the torch
row of the same format ("speedup") and with the fastest torch row ("vs best torch").

Step memory is tensor-level: the peak rise of live tensor bytes during one step, from the allocator's
events (:func:`mpitrain.perf.memory.step_memory`): activations, gradients, halos, message buffers and
kernel workspaces, not the model or the global batch that exist before the step.

``--ceiling`` adds, per grid, every rank training plain torch on its own block at the same time with
no communication at all: the speed-up a perfect spatial implementation could reach on this machine
(cores and memory bandwidth shared as in the spatial run), against which the spatial row's overheads
(halo and BatchNorm synchronisation, strips, Python) can be read.

Times: every contender's median over ``--rounds`` interleaved rounds of its median of ``--steps`` steps
(each after a barrier, slowest rank); a speed-up is the median of the per-round ratios
(:func:`~mpitrain.bench.common.paired_rounds`), so this VM's drifts (phases of seconds) cancel, and
"q25-q75" is its spread over the rounds.
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..comm.base import Communicator
from ..perf.memory import step_memory
from ..perf.spatial import conv_shapes, predict, time_local_conv
from ..spatial.conv import SpatialConv2d
from ..spatial.distribution import Distribution
from ..spatial.mesh import WIDTHS, mesh_batch, mesh_model
from ..spatial.models import UNet, cosmoflow, torchvision_module
from ..spatial.trainer import SpatialTrainer
from .common import (
    DEVICE_STEPS,
    add_outputs,
    add_precisions,
    alone_timer,
    header,
    median,
    on_rank0_alone,
    paired_ratio,
    paired_rounds,
    print_table,
    quartiles,
    rank_max,
    save_outputs,
    step_timer,
    time_call,
    without_cuda,
)

__all__ = ["main"]

_FORMATS = ("nchw", "cl")
Timer = Callable[[], float]


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpitrain bench spatial", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mesh", choices=("mesh", "resnet50", "unet", "cosmoflow"),
                   help="network to train")
    p.add_argument("--size", type=int, default=None, help="input side (paper: 1024 or 2048); default 1024, "
                                                           "--device cuda: 512")
    p.add_argument("--batch", type=int, default=None, help="global mini-batch N; default 1, --device cuda: 4")
    p.add_argument("--steps", type=int, default=1, help="timed steps per contender per round (median); "
                                                        "--device cuda: consecutive steps per timer, at least 10")
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds (ratios taken per round)")
    p.add_argument("--convs", type=int, default=3, help="conv-BN-ReLU per block (paper: 3 at 1K, 5 at 2K)")
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="filters per block")
    p.add_argument("--grids", default="auto", help="e.g. '2x1,1x2' (ph x pw per sample); auto: all splits")
    p.add_argument("--formats", default="nchw,cl", help="memory formats to run: nchw, cl (channels-last)")
    p.add_argument("--no-overlap-row", action="store_true", help="skip the overlap=False comparison row")
    p.add_argument("--baseline", action="store_true", help="time plain torch on rank 0 alone first")
    p.add_argument("--ceiling", action="store_true",
                   help="also time every rank training plain torch on its own block at once, no messages")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: ms/step on each rank's GPU vs one process of plain torch (mpitrain.bench."
                        "_spatial_cuda); --baseline, --ceiling and the model columns do not apply")
    add_precisions(p)
    add_outputs(p)
    args = p.parse_args(list(argv))
    cuda = args.device == "cuda"
    args.size = args.size if args.size is not None else (512 if cuda else 1024)
    args.batch = args.batch if args.batch is not None else (4 if cuda else 1)
    return args


def _grids(size: int, batch: int, spec: str) -> list[tuple[tuple[int, ...], int]]:
    """(grid, samples) configurations for `size` ranks (``2x1``, ``1x2x2``, ...; auto: 2-D splits)."""
    if spec != "auto":
        out = []
        for g in spec.split(","):
            grid = tuple(int(v) for v in g.lower().split("x"))
            out.append((grid, size // math.prod(grid)))
        return out
    per = [p for p in (1, 2, 4, 8) if size % p == 0 and size // p <= batch]
    auto: list[tuple[tuple[int, ...], int]] = []
    for p in per:
        auto += [((p, 1), size // p)] + ([((1, p), size // p)] if p == 2 else [])
        auto += [((2, 2), size // 4)] if p == 4 else []
    return auto


def _fmt(fmt: str, dims: int) -> torch.memory_format:
    """The memory format `fmt` for tensors of `dims` dimensions (channels-last has a 3-D form)."""
    if fmt == "cl":
        return torch.channels_last if dims == 4 else torch.channels_last_3d
    return torch.contiguous_format


def _torch_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module) -> Callable[[], float]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def _link(comm: Communicator) -> tuple[float, float]:
    """(alpha, beta) of a halo-sized exchange between neighbours: sendrecv times at 8 B and 4 MiB."""
    if comm.size == 1:
        return 0.0, 0.0
    peer = comm.rank ^ 1 if (comm.rank ^ 1) < comm.size else comm.rank
    times = []
    for n in (2, 1 << 20):
        buf, out = torch.zeros(n), torch.empty(n)
        def exchange(b: torch.Tensor = buf, o: torch.Tensor = out) -> object:
            return comm.sendrecv(b, peer, o, peer)

        ts = time_call(exchange, 5, warmup=1, sync=comm.barrier)
        times.append(min(ts))
    alpha = times[0]
    return alpha, max(0.0, (times[1] - alpha) / (4 << 20))


def _predicted(model: nn.Module, shape: tuple[int, ...], grid: tuple[int, int], samples: int,
               link: tuple[float, float], overlap: bool) -> float:
    """§V-A model: measured local conv times on this rank's block plus modelled halo/allreduce time."""
    shapes = conv_shapes(model, shape)
    measured = {s: time_local_conv(s, grid, samples) for s in set(shapes)}
    return predict(shapes, grid, samples, measured.__getitem__, *link, overlap=overlap)


class _Row:
    """One contender: its label, a timer (median step seconds), and what is measured once."""

    def __init__(self, label: str, fmt: str, grid: tuple[int, ...], samples: int, timer: Timer,
                 memory: Callable[[], float], wait: Callable[[], float], model_s: float) -> None:
        self.label, self.fmt, self.grid, self.samples = label, fmt, grid, samples
        self.timer, self.memory, self.wait, self.model_s = timer, memory, wait, model_s


def _torch_row(args: argparse.Namespace, comm: Communicator, model: nn.Module,
               x: torch.Tensor, y: torch.Tensor, fmt: str) -> _Row:
    step = _torch_step(model, x, y, args.loss_fn)  # only rank 0 runs it

    def memory() -> float:
        return on_rank0_alone(comm, lambda: step_memory(step) / 2**20)

    model_s = _predicted(model, tuple(x.shape), (1, 1), 1, (0.0, 0.0), False) if args.model == "mesh" else 0.0
    return _Row(f"torch, 1 process ({fmt})", fmt, (1, 1), 1, alone_timer(comm, step, args.steps), memory,
                lambda: 0.0, model_s)


def _spatial_row(args: argparse.Namespace, comm: Communicator, model: nn.Module,
                 x: torch.Tensor, y: torch.Tensor, fmt: str,
                 grid: tuple[int, ...], samples: int, overlap: bool) -> _Row:
    dist = Distribution(comm, grid, samples)
    trainer = SpatialTrainer(copy.deepcopy(model), args.loss_fn,
                             lambda p: torch.optim.SGD(p, lr=1e-3), dist, overlap=overlap)
    convs = [m for m in trainer.parallel.modules() if isinstance(m, SpatialConv2d)]

    def step() -> None:
        trainer.train_step(x, y)

    def wait() -> float:
        for m in convs:
            m.stats.reset()
        step()
        return sum(m.stats.wait_s for m in convs)

    mesh = args.model == "mesh" and len(grid) == 2
    predicted = _predicted(model, tuple(x.shape), (grid[0], grid[1]), samples, args.link, overlap) if mesh else 0.0
    model_s = rank_max(comm, predicted)
    label = f"spatial {'x'.join(map(str, grid))} ({fmt})" + ("" if overlap else " no-overlap")
    return _Row(label, fmt, grid, samples, step_timer(comm, step, args.steps),
                lambda: rank_max(comm, step_memory(step) / 2**20), lambda: rank_max(comm, wait()), model_s)


def _ceiling_row(args: argparse.Namespace, comm: Communicator, model: nn.Module,
                 x: torch.Tensor, y: torch.Tensor, fmt: str,
                 grid: tuple[int, ...], samples: int) -> _Row:
    """Every rank trains plain torch on its own block (a copy in `fmt`), all at once, with no message:
    what this machine's cores and shared memory allow a perfect implementation of that split. A model
    whose dense head is sized for whole samples (a Sequential with Flatten) trains its trunk only."""
    dist = Distribution(comm, grid, samples)
    block = x[dist.index(tuple(x.shape))].contiguous(memory_format=_fmt(fmt, x.dim()))
    model, loss_fn = copy.deepcopy(model), args.loss_fn
    if isinstance(model, nn.Sequential) and any(isinstance(m, nn.Flatten) for m in model):
        model = model[:[isinstance(m, nn.Flatten) for m in model].index(True)]
        loss_fn = nn.MSELoss()
    with torch.no_grad():
        out = model(block[:1])
    g = torch.Generator().manual_seed(0)
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        target = torch.randint(0, out.shape[1], (block.shape[0], *out.shape[2:]), generator=g)
    else:
        target = torch.randn((block.shape[0], *out.shape[1:]), generator=g)
    step = _torch_step(model, block, target, loss_fn)
    label = f"ceiling {'x'.join(map(str, grid))} ({fmt})"
    return _Row(label, fmt, grid, samples, step_timer(comm, step, args.steps),
                lambda: rank_max(comm, step_memory(step) / 2**20), lambda: 0.0, 0.0)


def _rows(args: argparse.Namespace, comm: Communicator, model: nn.Module,
          x: torch.Tensor, y: torch.Tensor) -> list[_Row]:
    rows = []
    for fmt in args.formats:
        m = copy.deepcopy(model).to(memory_format=_fmt(fmt, x.dim()))  # type: ignore[call-overload]
        xf = x.contiguous(memory_format=_fmt(fmt, x.dim()))
        if args.baseline or comm.size == 1:
            rows.append(_torch_row(args, comm, m, xf, y, fmt))
        for grid, samples in _grids(comm.size, args.batch, args.grids):
            if args.ceiling and comm.size > 1:
                rows.append(_ceiling_row(args, comm, m, xf, y, fmt, grid, samples))
            rows.append(_spatial_row(args, comm, m, xf, y, fmt, grid, samples, True))
            if math.prod(grid) > 1 and not args.no_overlap_row and len(grid) == 2:
                rows.append(_spatial_row(args, comm, m, xf, y, fmt, grid, samples, False))
    return rows


def _workload(args: argparse.Namespace) -> tuple[nn.Module, torch.Tensor, torch.Tensor, str]:
    """(model, inputs, targets, title) of ``--model`` at ``--size`` (the same on every rank); sets
    ``args.loss_fn``, the model's loss."""
    args.loss_fn = nn.MSELoss() if args.model == "cosmoflow" else nn.CrossEntropyLoss()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    n, size = args.batch, args.size
    if args.model == "resnet50":
        model = torchvision_module("models.resnet").resnet50(num_classes=10)
        x, y = torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)
        return model, x, y, f"torchvision ResNet-50 {size}^2, N={n}"
    if args.model == "unet":
        model = UNet(in_channels=3, width=16, depth=3, classes=2)
        x, y = torch.randn(n, 3, size, size, generator=g), torch.randint(0, 2, (n, size, size), generator=g)
        return model, x, y, f"U-Net (width 16, depth 3) {size}^2, N={n}"
    if args.model == "cosmoflow":
        blocks = max(1, (size // 4).bit_length() - 1)  # pool down to a 4^3 (or smaller) volume
        widths3 = tuple(min(16 * 2**i, 64) for i in range(blocks))
        model = cosmoflow(size, 4, widths3, dense=64)
        x, y3 = torch.randn(n, 4, size, size, size, generator=g), torch.randn(n, 4, generator=g)
        return model, x, y3, f"CosmoFlow-style 3-D {size}^3, N={n}, widths {widths3}"
    widths = tuple(int(w) for w in args.widths.split(","))
    model = mesh_model(widths=widths, convs_per_block=args.convs)
    x, y = mesh_batch(n, size, blocks=len(widths))
    return model, x, y, f"mesh model {size}^2, N={n}, widths {widths}, {args.convs} convs/block"


def main(argv: Sequence[str]) -> int:
    import mpitrain

    args = _parse(argv)
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in args.formats if f not in _FORMATS]
    if bad:
        raise SystemExit(f"unknown --formats {bad}; choose from {sorted(_FORMATS)}")
    if args.device == "cuda":
        return _main_cuda(args)
    comm = mpitrain.init()
    model, x, y, title = _workload(args)
    args.link = _link(comm)
    rows = _rows(args, comm, model, x, y)
    runs = paired_rounds({r.label: r.timer for r in rows}, args.rounds)
    times = {label: median(v) for label, v in runs.items()}
    mems = {r.label: r.memory() for r in rows}
    waits = {r.label: r.wait() for r in rows}
    torch_runs = {r.fmt: runs[r.label] for r in rows if r.label.startswith("torch")}
    torch_m = {r.fmt: mems[r.label] for r in rows if r.label.startswith("torch")}
    best = min(torch_runs.values(), key=median) if torch_runs else None
    if comm.rank == 0:
        print(header(f"spatial: {title}", comm.size))
        print(f"# link: alpha {args.link[0] * 1e6:.1f} us, beta {args.link[1] * 1e9:.3f} ns/B; model = §V-A "
              f"conv cost (measured local convs + modelled halos/allreduce; other layers free)")

        def ratio(a: float | None, b: float | None) -> object:
            return a / b if a and b else "-"

        def speedup(base: list[float] | None, label: str) -> object:
            return paired_ratio(base, runs[label]) if base else "-"

        def spread(base: list[float] | None, label: str) -> object:
            return quartiles([a / b for a, b in zip(base, runs[label])]) if base else "-"

        ceilings = {(r.fmt, r.grid, r.samples): runs[r.label] for r in rows if r.label.startswith("ceiling")}
        table = [[r.label, math.prod(r.grid), r.samples, times[r.label],
                  speedup(torch_runs.get(r.fmt), r.label), spread(torch_runs.get(r.fmt), r.label),
                  speedup(best, r.label), speedup(ceilings.get((r.fmt, r.grid, r.samples)), r.label),
                  mems[r.label], ratio(mems[r.label], torch_m.get(r.fmt)),
                  waits[r.label], r.model_s or "-"] for r in rows]
        print_table(["config", "ranks/sample", "groups", "step s", "speedup", "q25-q75", "vs best torch",
                     "vs ceiling", "step MiB/rank", "mem ratio", "halo wait s", "model conv s"], table)
    save_outputs(args, "spatial", comm.size, comm.rank)
    return 0


def _main_cuda(args: argparse.Namespace) -> int:
    """``--device cuda`` (:mod:`mpitrain.bench._spatial_cuda`): status 2, saying why, without CUDA."""
    import mpitrain

    from . import _spatial_cuda

    refused = without_cuda("spatial")  # the same verdict on every rank, before any message
    if refused is not None:
        return refused
    args.steps = max(args.steps, DEVICE_STEPS)
    comm = mpitrain.init()
    model, x, y, title = _workload(args)
    _spatial_cuda.run(args, model, x, y, title, _grids(comm.size, args.batch, args.grids), _fmt)
    save_outputs(args, "spatial-cuda", comm.size, comm.rank)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
