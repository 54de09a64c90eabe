"""Per-rank peak memory of ``fit(strategy="data", zero=k)`` (and hybrid) on a real-size model, over one
process's parameters + gradients + Adam state.

What is measured (docs/data-parallel.md, "Memory per rank"): the growth of this rank's resident memory
from just before the model is built to its peak during the run, ``VmHWM`` after the run minus ``VmRSS``
before building, with the kernel's peak counter reset first (``/proc/self/clear_refs`` = 5). So it
counts every byte the rank touched for the model, its gradients, the optimizer state, communication
buffers, activations and allocator slack. One configuration per process (memory a run freed stays with
the process), so run it once per row::

    mpitrain run -n 4 -- python -m mpitrain.bench._zero_memory --zero 3

:func:`fit_peak` is the function ``mpitrain bench memory`` calls for its ZeRO rows.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.base import Communicator

__all__ = ["fit_peak", "linear_stack", "reference_bytes", "resident", "main"]


def resident(field: str = "VmRSS") -> int:
    """This process's ``VmRSS`` / ``VmHWM`` (bytes) from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Set VmHWM back to the current VmRSS (Linux: ``5`` written to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def linear_stack(layers: int = 16, width: int = 2048) -> nn.Module:
    """`layers` x Linear(width, width) with ReLUs, float32: 16 x 2048 -> 67.1 M parameters, 268.5 MB."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods += [nn.Linear(width, width)] + ([nn.ReLU()] if i < layers - 1 else [])
    return nn.Sequential(*mods)


def reference_bytes(model: nn.Module) -> int:
    """One process's parameters + gradients + Adam's two moments: four times the parameters' bytes."""
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def fit_peak(comm: Communicator, build: Callable[[], nn.Module], fit_options: Mapping[str, object],
             steps: int = 3, rows: int = 8) -> int:
    """Collective: this rank's peak resident growth (bytes) while `build()` makes the model and ``fit``
    trains it `steps` steps with Adam on global batches of `rows` random rows (``fit_options``: the
    strategy and its options, e.g. ``{"strategy": "data", "zero": 3}``), after the same run on a tiny
    model (imports, threads, communicators and MPI's own buffers are not the model's)."""
    from ..fit import fit

    def run(model: nn.Module) -> None:
        width = next(model.parameters()).shape[1]
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)) for _ in range(steps)]
        fit(model, data, F.mse_loss, lambda ps: torch.optim.Adam(ps, lr=1e-4), comm=comm, progress=False,
            **fit_options)  # type: ignore[arg-type]

    run(linear_stack(4, 8))  # first: imports, threads, communicators and MPI's buffers are not the model's
    gc.collect()
    comm.barrier()
    _reset_peak()
    base = resident("VmRSS")
    run(build())
    return resident("VmHWM") - base


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
    peak = fit_peak(comm, lambda: linear_stack(args.layers, args.width), options, args.steps)
    peaks = comm.allgather_object(peak)
    if comm.rank == 0:
        ref = reference_bytes(linear_stack(args.layers, args.width))
        row = " ".join(f"{x / 2**20:.0f}" for x in peaks)
        print(f"{args.strategy} zero={args.zero} P={args.partitions} ranks={comm.size}: one process's "
              f"params+grads+Adam {ref / 2**20:.0f} MiB; per-rank peak growth MiB [{row}]; max/ref "
              f"{max(peaks) / ref:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
