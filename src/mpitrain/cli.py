"""The `mpitrain` command: run | bench | demo | timeline."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from .launch import LaunchSpec, in_mpi_job, launch, run_module

__all__ = ["main", "BENCHMARKS"]

#: ``mpitrain bench NAME`` runs ``python -m mpitrain.bench.NAME`` under mpiexec.
BENCHMARKS = {
    "machine": "each kernel alone vs on every rank at once: the machine's speed-up ceiling",
    "allreduce": "Communicator allreduce (flat, hierarchical) vs raw mpi4py and gloo: latency, busbw",
    "dataparallel": "DataParallel steps/s per kvstore type vs torch DDP (gloo)",
    "kvstore": "parameter server push+pull (1/2/4 servers) vs allreduce; funnel/concurrent/depchain",
    "pipeline": "sequential vs model vs data vs hybrid img/s; pipeline efficiency vs M/(M+P-1)",
    "pipesgd": "Pipe-SGD timing model predicted vs measured; Fig. 4-style table",
    "spatial": "mesh model strong scaling and memory per rank",
    "spatial_models": "the spatial conformance set: equal to one process?, redistributions/step, memory/rank",
    "planner": "the planner's predictions vs measured steps: error, regret, chosen plan per workload",
    "fit": "fit vs a hand-written loop on short epochs: ms/step, ratio, extra ms per epoch (--device cuda)",
    "horovod": "Horovod-style synthetic img/s: mpitrain.horovod DistributedOptimizer vs DataParallel vs DDP",
    "memory": "per-rank peak memory of fit (data, model, hybrid) over one process's params + grads",
}


def _spec(args: argparse.Namespace, np: int | None, command: list[str]) -> LaunchSpec:
    """The LaunchSpec for the shared launch arguments; -n defaults to SLURM_NTASKS inside an allocation."""
    if np is None:
        ntasks = os.environ.get("SLURM_NTASKS", "")
        if not ntasks.isdigit():
            raise ValueError("-n is required outside a Slurm allocation")
        np = int(ntasks)
    env: dict[str, str | None] = {}
    for item in args.x or []:
        name, eq, value = item.partition("=")
        env[name] = value if eq else None
    return LaunchSpec(np=np, command=command, hosts=args.hosts, hostfile=args.hostfile, threads=args.threads,
                      env=env, mca=[(k, v) for k, v in args.mca or []])


def _launched(what: str, start: Callable[[], int]) -> int:
    """Run `start`; a bad argument becomes a one-line error and exit status 2 (nothing was started)."""
    try:
        return int(start())
    except (ValueError, FileNotFoundError) as e:
        print(f"mpitrain {what}: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    return _launched("run", lambda: launch(_spec(args, args.n, cmd), dry_run=args.dry_run))


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    module = f"mpitrain.bench.{args.name}"
    if in_mpi_job():  # already a rank: run in place
        return int(importlib.import_module(module).main(rest) or 0)
    return _launched("bench", lambda: run_module(_spec(args, args.n, []), module, rest, dry_run=args.dry_run))


def _demo(args: argparse.Namespace, rest: list[str]) -> int:
    forwarded = ["--strategy", args.strategy, *rest]
    if in_mpi_job():
        return int(importlib.import_module("mpitrain.demo").main(forwarded) or 0)
    return _launched("demo", lambda: run_module(_spec(args, args.n, []), "mpitrain.demo", forwarded,
                                                dry_run=args.dry_run))


def _launch_args(p: argparse.ArgumentParser, np_default: int | None,
                 np_flags: tuple[str, ...] = ("-n", "-np", "--np")) -> None:
    """The launch arguments shared by run, bench and demo (``-np``: mpirun's spelling of ``-n``)."""
    p.add_argument(*np_flags, dest="n", type=int, default=np_default,
                   help="number of ranks" + ("" if np_default else " (default: SLURM_NTASKS in an allocation)"))
    p.add_argument("-H", "--hosts", help="host1:slots,host2:slots (default: the Slurm allocation's nodes)")
    p.add_argument("--hostfile", help="MPI hostfile: 'name [slots=N]' per line")
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank (OMP_NUM_THREADS)")
    p.add_argument("-x", action="append", metavar="NAME[=VALUE]",
                   help="set/forward an environment variable to every rank (MPITRAIN_* always are)")
    p.add_argument("--mca", nargs=2, action="append", metavar=("KEY", "VALUE"), help="Open MPI MCA parameter")
    p.add_argument("--dry-run", action="store_true", help="print the exact command and exit")


def _plan(args: argparse.Namespace, rest: list[str]) -> int:
    """``mpitrain plan``: the planner's command (mpitrain.planner.command) on N ranks (or in place)."""
    module = "mpitrain.planner.command"
    if in_mpi_job():
        return int(importlib.import_module(module).main(rest) or 0)
    return _launched("plan", lambda: run_module(_spec(args, args.n, []), module, rest, dry_run=args.dry_run))


# -- mpitrain timeline plot TRACE -o OUT | bubble TRACE (docs/timeline.md) --------------------------------------------
def _timeline_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("timeline", help="work with a timeline JSON (fit(timeline=...), MPITRAIN_TIMELINE)")
    tsub = t.add_subparsers(dest="action", required=True)
    p = tsub.add_parser("plot", help="draw a timeline JSON as a Gantt chart (one row per rank and thread)")
    p.add_argument("trace", help="the timeline JSON")
    p.add_argument("-o", "--out", required=True, help="image file (PNG, SVG, PDF: from the suffix)")
    p.add_argument("--start", type=float, help="ms since the start: left edge of the window")
    p.add_argument("--end", type=float, help="ms since the start: right edge of the window")
    p.add_argument("--title")
    o = tsub.add_parser("bubble", help="how busy each rank's pipeline actions keep it, per step (the bubble)")
    o.add_argument("trace", help="the timeline JSON of a fit run")
    o.add_argument("--skip", type=int, default=1, help="first steps left out (the first one sets up)")


def _timeline(args: argparse.Namespace) -> int:
    from .timeline import format_occupancy, occupancy, plot

    try:
        if args.action == "bubble":
            print(format_occupancy(occupancy(args.trace, args.skip)))
        else:
            print(plot(args.trace, args.out, title=args.title, start_ms=args.start, end_ms=args.end))
    except (OSError, ValueError, KeyError) as e:
        print(f"mpitrain timeline {args.action}: cannot read {args.trace}: {e!r}", file=sys.stderr)
        return 2
    return 0
# -----------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpitrain", description="Train PyTorch models across processes over MPI.")
    sub = p.add_subparsers(dest="verb", required=True)

    r = sub.add_parser("run", help="launch COMMAND on N ranks through mpiexec")
    _launch_args(r, None)
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")

    b = sub.add_parser("bench", help="run a benchmark: " + ", ".join(BENCHMARKS))
    b.add_argument("name", choices=sorted(BENCHMARKS))
    _launch_args(b, 2)

    d = sub.add_parser("demo", help="train a small CNN on scikit-learn's digits")
    _launch_args(d, 2, ("--ranks", "-n", "-np", "--np"))
    d.add_argument("--strategy", default="model")
    pl = sub.add_parser("plan", help="rank the ways to train MODULE:FACTORY on N ranks (see mpitrain plan -h)",
                        add_help=False)
    _launch_args(pl, 2)
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
    if args.verb == "plan":
        return _plan(args, rest)
    if args.verb == "timeline":
        return _timeline(p.parse_args(argv))
    return _demo(args, rest)


if __name__ == "__main__":
    sys.exit(main())
