"""Per-rank peak memory of training runs: how far each rank's resident set rises during one `fit`, over
one process's parameters + gradients (+ optimizer state).

Run as ``mpitrain bench memory -n N [--width 2048] [--depth 16] [--batch 8] [--micro-batches 2]
[--steps 2] [--optimizer sgd|adam] [--rows NAME,...] [--json FILE] [--plot FILE.png]``. The model is
``depth`` linear layers ``width`` x ``width`` (with bias, float32; 16 x 2048^2 = 67 M parameters, 268 MB),
built on the meta device ("meta": each rank materialises only its partitions) or on the CPU ("cpu":
every rank builds the whole model, as a user does, before `fit`; its own memory is not counted).
Rows at -n N: data parallelism (R = N, the reference: every rank holds everything), model (P = N) and,
at an even N >= 4, hybrid (P = N/2 x R = 2), each with ``balance="params"`` and ``"time"``.

A row's number is :func:`peak_growth` of its `fit`: the peak of the resident set (VmHWM, reset
before the run) minus the resident set just before it, glibc's free memory returned to the kernel
first, so that memory the run reuses counts. Rows run one after another in the same processes; before
the first, one optimizer step on a tiny model pays what any torch training pays once (its first step
imports torch._dynamo: ~90 MB resident), so that it is not charged to the first row. "over own" is
the growth minus what this rank cannot avoid adding: its gradients (its partitions', or the whole
model's under data parallelism) and, of a "meta" model, the parameters it materialises. The target
column is issue #27's for the layouts it names (P = 2: 0.6, P = 4: 0.35, hybrid by its P).

``--zero`` runs ZeRO's rows instead (docs/data-parallel.md, "Memory per rank"): data parallelism with
``zero`` = 0..3 and, at an even N >= 4, hybrid P = N/2 x R = 2 with ``zero`` = 0..2, the model built on
the CPU *inside* the measured run ("counted": ZeRO frees the model's own parameter memory, which a row
building it before would hide), after the same fit on a tiny model (its communicators and threads are
not the model's); targets 0.70 / 0.50 / 0.35 for data zero=1/2/3 (over params + grads + Adam: pass
``--optimizer adam``). ZeRO >= 2 lowers glibc's mmap threshold for the rest of the process, so run one
ZeRO row per command (``--rows``). :func:`fit_peak` measures one row (collective).

``--lora R`` fine-tunes instead: every layer's weight and bias frozen (``requires_grad=False``) with a
trainable rank-R adapter beside it (:class:`LoRALinear`, peft's LoRA), and the reference becomes one
process's frozen weights + the adapters' parameters and gradients (+ Adam state): a strategy that gave
the frozen weights gradient buffers would peak a whole model above it (docs/data-parallel.md).
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

import mpitrain
from mpitrain._utils.malloc import mmap_threshold, release_free_memory
from mpitrain.bench.common import add_outputs, header, print_table, save_outputs
from mpitrain.comm.base import Communicator
from mpitrain.fit import fit

__all__ = ["Contender", "contenders", "zero_contenders", "fit_peak", "peak_growth", "resident", "reference_bytes",
           "main", "TARGETS", "ZERO_TARGETS", "LoRALinear"]

T = TypeVar("T")

#: Issue #27's targets: peak growth per rank over one process's params + grads, by partitions P.
TARGETS = {2: 0.6, 4: 0.35}
#: Issue #27's ZeRO targets at 4 ranks: over one process's params + grads + Adam state, by stage.
ZERO_TARGETS = {1: 0.70, 2: 0.50, 3: 0.35}


@dataclass(frozen=True)
class Contender:
    """One row: `fit(strategy=strategy, **options)` on the model built on `build` ("meta", "cpu", or
    "counted": on the CPU inside the measured run)."""

    name: str
    strategy: str
    build: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def partitions(self) -> int:
        return int(self.options.get("partitions", 1))

    @property
    def target(self) -> float | None:
        """Issue #27's target for this row, if it names one."""
        zero = int(self.options.get("zero", 0))
        if zero:
            return ZERO_TARGETS.get(zero) if self.strategy == "data" else None
        return TARGETS.get(self.partitions) if self.strategy != "data" else None


def contenders(size: int) -> list[Contender]:
    """The rows at `size` ranks: data parallelism first (it runs before any pipeline lowers glibc's
    mmap threshold in these processes), then model and hybrid, each balance, meta and CPU-built."""
    rows = [Contender("data", "data", "cpu")]
    layouts = [("model", size, None)] + ([("hybrid", size // 2, 2)] if size >= 4 and size % 2 == 0 else [])
    for strategy, P, R in layouts:
        for build in ("meta", "cpu"):
            for balance in ("params", "time"):
                options: dict[str, Any] = {"partitions": P, "balance": balance}
                if R is not None:
                    options["replicas"] = R
                rows.append(Contender(f"{strategy} P={P}" + (f"xR={R}" if R else "") + f" {balance} {build}",
                                      strategy, build, options))
    return rows


def zero_contenders(size: int) -> list[Contender]:
    """ZeRO's rows at `size` ranks, the model counted: data parallelism with zero = 0..3 and, at an even
    `size` >= 4, hybrid P = size/2 x R = 2 with zero = 0..2 (``balance="params"``)."""
    rows = [Contender(f"data zero={k}", "data", "counted", {"zero": k}) for k in range(4)]
    if size >= 4 and size % 2 == 0:
        rows += [Contender(f"hybrid P={size // 2}xR=2 zero={k}", "hybrid", "counted",
                           {"partitions": size // 2, "replicas": 2, "balance": "params", "zero": k})
                 for k in range(3)]
    return rows


def resident() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes, from /proc/self/status (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out["VmRSS"], out["VmHWM"]


def peak_growth(run: Callable[[], T]) -> tuple[int, T]:
    """Bytes by which this process's resident set peaks above its level just before `run()`, and what
    `run` returned. Garbage is collected and glibc's free heap memory returned to the kernel first (so
    memory the run reuses counts), and the peak (VmHWM) is reset through /proc/self/clear_refs."""
    gc.collect()
    release_free_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to VmRSS (Linux >= 4.0)
    before, _ = resident()
    out = run()
    return resident()[1] - before, out


class LoRALinear(nn.Linear):
    """A frozen ``Linear(width, width)`` plus a trainable low-rank update ``x A^T B^T`` (peft's LoRA with
    scale 1; ``B`` starts at zero, as peft's)."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__(width, width)
        self.requires_grad_(False)  # the weight and bias; the adapters below train
        self.lora_A = nn.Parameter(torch.randn(rank, width) / width ** 0.5)
        self.lora_B = nn.Parameter(torch.zeros(width, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (x @ self.lora_A.t()) @ self.lora_B.t()


def _model(width: int, depth: int, build: str, lora: int = 0) -> nn.Module:
    """`depth` x Linear(width, width) (float32, with bias) on the meta device or the CPU; with `lora` > 0
    each a :class:`LoRALinear` of that rank (weights frozen)."""
    with torch.device("meta" if build == "meta" else "cpu"):
        torch.manual_seed(0)
        return nn.Sequential(*[LoRALinear(width, lora) if lora else nn.Linear(width, width) for _ in range(depth)])


def _optimizer(name: str) -> Callable[[Any], torch.optim.Optimizer]:
    if name == "adam":
        return lambda ps: torch.optim.Adam(ps, lr=1e-4)
    return lambda ps: torch.optim.SGD(ps, lr=1e-4)


def reference_bytes(model: nn.Module, optimizer: str) -> int:
    """One process's parameters + gradients (+ Adam's two moments) of `model`, in bytes: frozen parameters
    (``requires_grad=False``) count once, they have neither."""
    trained = sum(q.numel() * q.element_size() for q in model.parameters() if q.requires_grad)
    frozen = sum(q.numel() * q.element_size() for q in model.parameters() if not q.requires_grad)
    return frozen + trained * (4 if optimizer == "adam" else 2)


def _own_bytes(model: nn.Module, build: str) -> int:
    """What this rank cannot avoid adding during a fit: its gradients (a pipeline's partition; the
    whole model under data parallelism) and, of a meta model or one built in the run ("counted"), the
    parameters it materialised."""
    grads = sum(q.numel() * q.element_size() for q in model.parameters() if q.grad is not None)
    made = sum(q.numel() * q.element_size() for q in model.parameters() if build != "cpu" and not q.is_meta)
    return grads + made


def fit_peak(comm: Communicator, row: Contender, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Collective: every rank's :func:`peak_growth` of `row`'s fit, and its own parameters + gradients,
    both over :func:`reference_bytes` (gathered: the same lists on every rank). A "counted" row builds
    the model inside the measured run, after the same fit on a 2 x Linear(8, 8) model."""
    options = {"micro_batches": args.micro_batches, **row.options} if row.strategy != "data" else row.options

    def data(width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(0)
        return [(torch.randn(args.batch, width, generator=g), torch.randn(args.batch, width, generator=g))
                for _ in range(args.steps)]

    def run(make: Callable[[], nn.Module], batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        return fit(make(), batches, nn.MSELoss(), _optimizer(args.optimizer), strategy=row.strategy, comm=comm,
                   progress=False, **options)

    lora = getattr(args, "lora", 0)  # a namespace built before --lora existed: every weight trains
    if row.build == "counted":
        run(lambda: _model(8, 2, "cpu", lora), data(8))
        comm.barrier()
        make = lambda: _model(args.width, args.depth, "cpu", lora)  # noqa: E731
    else:
        built = _model(args.width, args.depth, row.build, lora)
        make = lambda: built  # noqa: E731
    batches = data(args.width)
    grown, result = peak_growth(lambda: run(make, batches))
    ref = reference_bytes(_model(args.width, args.depth, "meta", lora), args.optimizer)
    mine = (grown / ref, _own_bytes(result.model, row.build) / ref)
    seen = comm.allgather_object(mine)
    return [g for g, _ in seen], [o for _, o in seen]


def _warm() -> None:
    """One optimizer step on a tiny model: what any torch training pays once (its imports)."""
    tiny = nn.Linear(2, 2)
    opt = _optimizer("sgd")(tiny.parameters())
    tiny(torch.ones(1, 2)).sum().backward()
    opt.step()


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpitrain bench memory", description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--rows", default="", help="comma list of row names to run (default: all)")
    p.add_argument("--zero", action="store_true", help="ZeRO's rows (the model counted), not the pipeline's")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="freeze every layer's weights and train a rank-R adapter beside each (0: all train)")
    add_outputs(p)
    return p.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    comm = mpitrain.init()
    wanted = {r.strip() for r in args.rows.split(",") if r.strip()}
    rows = [r for r in (zero_contenders if args.zero else contenders)(comm.size) if not wanted or r.name in wanted]
    _warm()
    table: list[list[object]] = []
    for row in rows:
        grown, own = fit_peak(comm, row, args)
        target = None if args.lora else row.target  # issue #27's targets are for models that train whole
        table.append([row.name, max(grown), max(g - o for g, o in zip(grown, own)),
                      " ".join(f"{g:.3f}" for g in grown), " ".join(f"{o:.3f}" for o in own),
                      "-" if target is None else target, f"{mmap_threshold() >> 20} MiB"])
    if comm.rank == 0:
        ref = reference_bytes(_model(args.width, args.depth, "meta", args.lora), args.optimizer)
        lora = f" frozen, LoRA rank {args.lora} adapters trained" if args.lora else ""
        print(header(f"Per-rank peak growth during fit over one process's params + grads"
                     f"{' + Adam state' if args.optimizer == 'adam' else ''} ({ref / 1e6:.0f} MB: {args.depth} x "
                     f"Linear {args.width}^2{lora}, {args.optimizer}, batch {args.batch}, M={args.micro_batches}, "
                     f"{args.steps} steps)", comm.size))
        print_table(["row", "max growth", "max over own", "growth per rank", "own per rank", "target",
                     "mmap threshold"], table)
    save_outputs(args, "memory", comm.size, comm.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
