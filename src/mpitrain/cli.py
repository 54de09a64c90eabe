"""The `mpitrain` command: run | bench | demo | timeline."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .launch import LaunchSpec, in_mpi_job, launch, run_module

__all__ = ["main", "BENCHMARKS"]

#: ``mpitrain bench NAME`` runs ``python -m mpitrain.bench.NAME`` under mpiexec.
BENCHMARKS = {
    "machine": "each kernel alone vs on every rank at once: the machine's speed-up ceiling",
    "allreduce": "Communicator allreduce vs raw mpi4py (and torch backend): latency, busbw",
    "dataparallel": "DataParallel steps/s per kvstore type vs torch DDP (gloo)",
    "kvstore": "parameter server push+pull (1/2/4 servers) vs allreduce; funnel/concurrent/depchain",
    "pipeline": "sequential vs model vs data vs hybrid img/s; pipeline efficiency vs M/(M+P-1)",
    "pipesgd": "Pipe-SGD timing model predicted vs measured; Fig. 4-style table",
    "spatial": "mesh model strong scaling and memory per rank",
}


def _run(args: argparse.Namespace) -> int:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    spec = LaunchSpec(np=args.n, command=cmd, hosts=args.hosts, hostfile=args.hostfile, threads=args.threads)
    try:
        return launch(spec, dry_run=args.dry_run)
    except (ValueError, FileNotFoundError) as e:
        print(f"mpitrain run: {e}", file=sys.stderr)
        return 2


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    module = f"mpitrain.bench.{args.name}"
    if in_mpi_job():  # already a rank: run in place
        return int(importlib.import_module(module).main(rest) or 0)
    return run_module(args.n, module, rest, threads=args.threads)


def _demo(args: argparse.Namespace, rest: list[str]) -> int:
    forwarded = ["--strategy", args.strategy, *rest]
    if in_mpi_job():
        return int(importlib.import_module("mpitrain.demo").main(forwarded) or 0)
    return run_module(args.ranks, "mpitrain.demo", forwarded, threads=args.threads)


# -- mpitrain timeline plot TRACE -o OUT (docs/timeline.md) --------------------------------------------
def _timeline_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    t = sub.add_parser("timeline", help="work with a timeline JSON (fit(timeline=...), MPITRAIN_TIMELINE)")
    tsub = t.add_subparsers(dest="action", required=True)
    p = tsub.add_parser("plot", help="draw a timeline JSON as a Gantt chart (one row per rank and thread)")
    p.add_argument("trace", help="the timeline JSON")
    p.add_argument("-o", "--out", required=True, help="image file (PNG, SVG, PDF: from the suffix)")
    p.add_argument("--start", type=float, help="ms since the start: left edge of the window")
    p.add_argument("--end", type=float, help="ms since the start: right edge of the window")
    p.add_argument("--title")


def _timeline(args: argparse.Namespace) -> int:
    from .timeline import plot

    try:
        print(plot(args.trace, args.out, title=args.title, start_ms=args.start, end_ms=args.end))
    except (OSError, ValueError, KeyError) as e:
        print(f"mpitrain timeline plot: cannot draw {args.trace}: {e!r}", file=sys.stderr)
        return 2
    return 0
# -----------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpitrain", description="Train PyTorch models across processes over MPI.")
    sub = p.add_subparsers(dest="verb", required=True)

    r = sub.add_parser("run", help="launch COMMAND on N ranks through mpiexec")
    r.add_argument("-n", "--np", dest="n", type=int, required=True, help="number of ranks")
    r.add_argument("-H", "--hosts", help="host1:slots,host2:slots")
    r.add_argument("--hostfile", help="MPI hostfile")
    r.add_argument("--threads", type=int, default=1, help="compute threads per rank (OMP_NUM_THREADS)")
    r.add_argument("--dry-run", action="store_true", help="print the exact command and exit")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")

    b = sub.add_parser("bench", help="run a benchmark: " + ", ".join(BENCHMARKS))
    b.add_argument("name", choices=sorted(BENCHMARKS))
    b.add_argument("-n", "--np", dest="n", type=int, default=2)
    b.add_argument("--threads", type=int, default=1)

    d = sub.add_parser("demo", help="train a small CNN on scikit-learn's digits")
    d.add_argument("--ranks", type=int, default=2)
    d.add_argument("--strategy", default="model")
    d.add_argument("--threads", type=int, default=1)
    _timeline_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args, rest = p.parse_known_args(argv)
    if args.verb == "run":
        return _run(p.parse_args(argv))
    if args.verb == "bench":
        return _bench(args, rest)
    if args.verb == "timeline":
        return _timeline(p.parse_args(argv))
    return _demo(args, rest)


if __name__ == "__main__":
    sys.exit(main())
