"""Per-rank peak memory of ``fit(strategy="data"|"hybrid", zero=k)`` on a real-size model, counting the
model itself, over one process's parameters + gradients + Adam state.

What is measured (docs/data-parallel.md, "Memory per rank"): :func:`mpitrain.bench.memory.peak_growth`
of building the model on the CPU *and* training it: ZeRO frees the model's own parameter memory, so the
model is counted (``mpitrain bench memory``'s "cpu" rows build it before the measured run). One
configuration per process (the mmap threshold ZeRO >= 2 lowers stays lowered), so run it once per row::

    mpitrain run -n 4 -- python -m mpitrain.bench._zero_memory --zero 3
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.base import Communicator
from .memory import peak_growth, reference_bytes

__all__ = ["zero_peak", "linear_stack", "main"]


def linear_stack(layers: int = 16, width: int = 2048) -> nn.Module:
    """`layers` x Linear(width, width) with ReLUs, float32: 16 x 2048 -> 67.1 M parameters, 268.5 MB."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods += [nn.Linear(width, width)] + ([nn.ReLU()] if i < layers - 1 else [])
    return nn.Sequential(*mods)


def zero_peak(comm: Communicator, build: Callable[[], nn.Module], fit_options: Mapping[str, object],
              steps: int = 3, rows: int = 8) -> int:
    """Collective: this rank's peak resident growth (bytes) while `build()` makes the model and ``fit``
    trains it `steps` steps with Adam on global batches of `rows` random rows (`fit_options`: the
    strategy and its options, e.g. ``{"strategy": "data", "zero": 3}``), after the same run on a tiny
    model (imports, threads, communicators and MPI's own buffers are not the model's)."""
    from ..fit import fit

    def run(make: Callable[[], nn.Module]) -> None:
        model = make()
        width = next(model.parameters()).shape[1]
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)) for _ in range(steps)]
        fit(model, data, F.mse_loss, lambda ps: torch.optim.Adam(ps, lr=1e-4), comm=comm, progress=False,
            **fit_options)  # type: ignore[arg-type]

    run(lambda: linear_stack(4, 8))
    comm.barrier()
    grown, _ = peak_growth(lambda: run(build))
    return grown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpitrain.bench._zero_memory", description=__doc__)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--strategy", default="data", choices=["data", "hybrid"])
    p.add_argument("--partitions", type=int, default=1)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    from ..runtime import init

    comm = init()
    options: dict[str, object] = {"strategy": args.strategy, "zero": args.zero}
    if args.strategy == "hybrid":
        options.update(partitions=args.partitions, micro_batches=2, balance="params")
    peaks = comm.allgather_object(zero_peak(comm, lambda: linear_stack(args.layers, args.width), options,
                                            args.steps))
    if comm.rank == 0:
        ref = reference_bytes(linear_stack(args.layers, args.width), "adam")
        row = " ".join(f"{x / 2**20:.0f}" for x in peaks)
        print(f"{args.strategy} zero={args.zero} P={args.partitions} ranks={comm.size}: one process's "
              f"params+grads+Adam {ref / 2**20:.0f} MiB; per-rank peak growth MiB [{row}]; max/ref "
              f"{max(peaks) / ref:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
