"""Shared benchmark plumbing: machine description, timing loops, the printed table and its
``--json FILE`` / ``--plot FILE.png`` outputs."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

import torch

from .._utils.stall import StallPolicy, poll
from ..comm.base import Communicator

__all__ = ["machine", "command_line", "time_call", "slowest_rank_times", "step_timer", "alone_timer", "rank_max",
           "median",
           "paired_rounds", "paired_ratio", "ms_against", "quartiles", "on_rank0_alone", "print_table", "header",
           "add_outputs", "save_outputs", "tables", "without_cuda", "DEVICE_STEPS", "PRECISIONS", "add_precisions",
           "device_line", "device_timer", "device_alone_timer"]


#: Waiting ranks test the broadcast with sleeps of at most a millisecond: they leave rank 0 its core.
_SLEEPY = StallPolicy(max_nap=1e-3, first_nap=1e-3)


def machine() -> str:
    """One line: host, CPU model, cores, torch and MPI versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        from mpi4py import MPI

        mpi = MPI.Get_library_version().split(",")[0].strip()
    except Exception:  # pragma: no cover - mpi4py always present in our install
        mpi = "?"
    return f"{platform.node()} | {cpu} | {os.cpu_count()} cores | torch {torch.__version__} | {mpi}"


def command_line(ranks: int) -> str:
    """The `mpitrain bench` command that reproduces this run (a benchmark runs as ``python -m``)."""
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    return " ".join(["mpitrain bench", name, "-n", str(ranks), *sys.argv[1:]])


def header(title: str, ranks: int) -> str:
    return f"# {title}\n# command: {command_line(ranks)}\n# ranks: {ranks}\n# machine: {machine()}"


def time_call(fn: Callable[[], object], repeats: int, warmup: int = 1,
              sync: Callable[[], object] | None = None) -> list[float]:
    """Wall-clock seconds of `repeats` calls of `fn` after `warmup` calls; `sync` runs before each
    timed call (e.g. a barrier) so ranks start together."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def slowest_rank_times(comm: Communicator, fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of `repeats` calls of `fn`, each started after a barrier, as the slowest rank's time
    (one float64 max-allreduce per call). Collective: every rank of `comm` calls it with the same counts."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        out.append(float(comm.allreduce(dt, op="max")[0]))
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def on_rank0_alone(comm: Communicator, fn: Callable[[], float]) -> float:
    """`fn()` run on rank 0 while the other ranks sleep (polling a nonblocking broadcast of the result
    with sleeps of up to a millisecond instead of busy-waiting in MPI), so rank 0 has a core to itself like one process.
    Collective over `comm`; returns rank 0's value on every rank."""
    out = torch.zeros(1, dtype=torch.float64)
    if comm.rank == 0:
        out[0] = fn()
    poll(comm.ibroadcast(out, root=0).test, _SLEEPY)
    return float(out[0])


def step_timer(comm: Communicator, step: Callable[[], object], steps: int) -> Callable[[], float]:
    """A timer for :func:`paired_rounds`: the median over `steps` calls of `step` of the slowest rank's
    seconds, no warm-up of its own (the untimed first round is the warm-up). Collective over `comm`."""
    return lambda: median(slowest_rank_times(comm, step, steps, warmup=0))


def alone_timer(comm: Communicator, step: Callable[[], object] | None, steps: int) -> Callable[[], float]:
    """A timer for :func:`paired_rounds`: the median over `steps` calls of `step` on rank 0 while the
    other ranks sleep (:func:`on_rank0_alone`; `step` may be None there), no warm-up of its own.
    Collective over `comm`."""
    def alone() -> float:
        assert step is not None, "rank 0 needs the step it times"
        return median(time_call(step, steps, warmup=0))

    return lambda: on_rank0_alone(comm, alone)


def _drained_seconds(step: Callable[[], object], steps: int, device: torch.device) -> float:
    """Seconds per step of `steps` back-to-back calls of `step`, `device` drained before the clock starts
    and before it stops (on a GPU the host only queues kernels; a CPU device needs no drain)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    if sync is not None:
        sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if sync is not None:
        sync()
    return (time.perf_counter() - t0) / max(steps, 1)


def device_timer(comm: Communicator, step: Callable[[], object], steps: int,
                 device: torch.device) -> Callable[[], float]:
    """A timer for :func:`paired_rounds`: seconds per step of `steps` consecutive calls of `step` on every
    rank at once (started after a barrier, `device` drained before each clock read), the slowest rank's.
    Back-to-back steps let the host queue the next step's kernels while the GPU runs, as training does.
    Collective over `comm`."""
    def timer() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        comm.barrier()
        return rank_max(comm, _drained_seconds(step, steps, device))

    return timer


def device_alone_timer(comm: Communicator, step: Callable[[], object] | None, steps: int,
                       device: torch.device) -> Callable[[], float]:
    """A timer for :func:`paired_rounds`: like :func:`device_timer` on rank 0 while the other ranks sleep
    (:func:`on_rank0_alone`; `step` may be None there): one process with the device to itself.
    Collective over `comm`."""
    def alone() -> float:
        assert step is not None, "rank 0 needs the step it times"
        return _drained_seconds(step, steps, device)

    return lambda: on_rank0_alone(comm, alone)


#: Consecutive steps a ``--device cuda`` timer takes at least: the host queues kernels ahead of the GPU
#: as training does, and the two drains per timer are amortised.
DEVICE_STEPS = 10


def without_cuda(benchmark: str) -> int | None:
    """Status 2, having said on stderr why ``mpitrain bench BENCHMARK --device cuda`` cannot run here (no
    CUDA device), or None where it can. Local, the same verdict on every rank: call it before any message."""
    if torch.cuda.is_available():
        return None
    print(f"mpitrain bench {benchmark} --device cuda: no CUDA device (torch.cuda.is_available() is False; "
          f"torch {torch.__version__}); run it on a GPU machine, or drop --device cuda for the CPU benchmark",
          file=sys.stderr)
    return 2


PRECISIONS = ("fp32", "bf16")


def _precisions(text: str) -> list[str]:
    out = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in out if v not in PRECISIONS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of {', '.join(PRECISIONS)}")
    return out


def add_precisions(p: argparse.ArgumentParser) -> None:
    """Give a benchmark's parser ``--precisions`` (``--device cuda``: fp32, bf16 autocast or both; a list
    after parsing, checked there: a bad value ends every rank with status 2 before any message)."""
    p.add_argument("--precisions", type=_precisions, default=list(PRECISIONS),
                   help="--device cuda: comma list of fp32, bf16 (bf16: autocast)")


def device_line(comm: Communicator, device: torch.device) -> str:
    """A header line naming `device`: the GPU's name, how many torch sees, how many ranks share it,
    whether the MPI backend hands device buffers to MPI (CUDA-aware) or stages them through pinned host
    memory (:func:`mpitrain.comm._cuda.mpi_cuda_aware`), whether fp32 matmuls and convolutions may use
    TF32, and the torch and CUDA versions."""
    if device.type != "cuda":
        return f"# device: {device}"
    from ..comm import mpi_cuda_aware

    count = torch.cuda.device_count()
    if comm.backend != "mpi":
        aware = f"n/a ({comm.backend} backend)"
    else:
        aware = "yes (device buffers direct)" if mpi_cuda_aware() else "no (staged through pinned host memory)"
    tf32 = (f"TF32 matmul {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}, "
            f"conv {'on' if torch.backends.cudnn.allow_tf32 else 'off'}")
    return (f"# device: {torch.cuda.get_device_name(device)} ({count} visible; {comm.size} ranks, up to "
            f"{-(-comm.size // max(count, 1))} per GPU); MPI CUDA-aware: {aware}; fp32 {tf32}; "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}")


def rank_max(comm: Communicator, value: float) -> float:
    """The largest `value` over the ranks of `comm` (collective: every rank calls it)."""
    return float(comm.allreduce(torch.tensor([value], dtype=torch.float64), op="max")[0])


def paired_rounds(timers: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Call every timer once per round, contenders interleaved, after one untimed warm-up round;
    returns every contender's results in round order. Collective when the timers are (same `timers`
    order on every rank).

    A shared machine's speed drifts in phases of seconds (benchmarks/README.md has a measurement).
    Results of different contenders in the same round are seconds apart at most, so compare them round
    by round (:func:`paired_ratio`) rather than across the whole run."""
    for timer in timers.values():
        timer()
    out: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(max(rounds, 1)):
        for name, timer in timers.items():
            out[name].append(timer())
    return out


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """The median over rounds of ``num[r] / den[r]`` (see :func:`paired_rounds`)."""
    return median([a / b for a, b in zip(num, den)])


def ms_against(seconds: Sequence[float], base: Sequence[float]) -> list[object]:
    """Table cells of a contender timed by :func:`paired_rounds` against `base` (the competitor's times,
    same rounds): median, min and max milliseconds per step, the median per-round time ratio over
    `base` and that ratio's q25-q75."""
    ratios = [a / b for a, b in zip(seconds, base)]
    return [1e3 * median(seconds), 1e3 * min(seconds), 1e3 * max(seconds), median(ratios), quartiles(ratios)]


def quartiles(values: Sequence[float]) -> str:
    """``"q25-q75"`` of `values` (the spread of a paired ratio over rounds), to 2 decimals."""
    v = sorted(values)
    return f"{v[len(v) // 4]:.2f}-{v[(3 * len(v)) // 4]:.2f}"


# Every table this process printed, in order: what --json saves and --plot draws.
_TABLES: list[dict[str, list[object]]] = []


def tables() -> list[dict[str, list[object]]]:
    """The tables printed so far by this process (``{"headers": [...], "rows": [[...], ...]}``)."""
    return list(_TABLES)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], file: TextIO | None = None) -> None:
    """A fixed-width text table (numbers formatted to 4 significant digits); also kept for
    :func:`save_outputs` (full precision)."""
    _TABLES.append({"headers": list(headers), "rows": [list(r) for r in rows]})
    def fmt(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    print(line, file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)), file=file)
    sys.stdout.flush()


def add_outputs(p: argparse.ArgumentParser) -> None:
    """Give a benchmark's parser the shared ``--json FILE`` and ``--plot FILE.png`` (see :func:`save_outputs`)."""
    p.add_argument("--json", default=None, metavar="FILE",
                   help="append this run's tables to FILE (JSON; runs at several -n accumulate: scaling plots)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw this benchmark's plot from the runs in --json FILE (or this run alone)")


def save_outputs(args: argparse.Namespace, benchmark: str, ranks: int, rank: int = 0, plot: bool = True) -> None:
    """On rank 0: append this run (benchmark, ranks, date, command, machine and every printed table) to
    ``args.json`` and draw ``args.plot`` from all runs of `benchmark` there (:mod:`mpitrain.bench._plots`).
    `plot=False` for a benchmark that draws its own chart into ``args.plot``. Other ranks do nothing."""
    if rank != 0 or not (getattr(args, "json", None) or getattr(args, "plot", None)):
        return
    run = {"benchmark": benchmark, "ranks": ranks, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": command_line(ranks), "machine": machine(), "tables": tables()}
    runs: list[dict[str, object]] = []
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            runs = json.load(f).get("runs", [])
    runs.append(run)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs}, f, indent=1, default=str)
        print(f"# tables appended to {args.json} ({len(runs)} runs)")
    if args.plot and plot:
        from ._plots import plot_runs

        plot_runs(runs, benchmark, args.plot)
        print(f"# plot written to {args.plot}")
