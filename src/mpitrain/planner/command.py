"""The rank side of ``mpitrain plan -n N MODULE:FACTORY --batch-shape ...``: plan, print, optionally measure."""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..runtime import init
from ..strategies.base import LossFn
from ._measure import measure_plan
from ._plan import parse_bytes, plan
from ._types import PlanError

__all__ = ["main", "parser", "load_factory", "synthetic_batch"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpitrain plan", description="Rank the ways to train a model on these ranks.")
    p.add_argument("factory", help="MODULE:FACTORY, a callable returning the torch.nn.Module")
    p.add_argument("--batch-shape", required=True, help="global input batch shape, e.g. 32,3,224,224")
    p.add_argument("--targets-shape", help="targets shape (default: the batch size: class labels)")
    p.add_argument("--loss", choices=("cross_entropy", "mse"), default="cross_entropy")
    p.add_argument("--memory-limit", help="bytes per rank, e.g. 8G (default: available memory / ranks per node)")
    p.add_argument("--strategies", help="comma-separated subset of the candidate strategies")
    p.add_argument("--exact", action="store_true",
                   help="only plans that compute what one process computes (no staleness, no lossy compression)")
    p.add_argument("--json", action="store_true", help="print the plans as JSON (rank 0)")
    p.add_argument("--measure", type=int, default=0, metavar="K", help="also run the top K plans and time them")
    p.add_argument("--steps", type=int, default=5, help="timed steps per measured plan")
    p.add_argument("--no-cache", action="store_true", help="measure again instead of using the cached calibration")
    p.add_argument("--explain", action="store_true", help="also list the dropped candidates and why")
    p.add_argument("--world-size", type=int, metavar="W",
                   help="price plans for W ranks from the calibration on these (extrapolated; not measurable)")
    return p


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """``"package.module:name"`` -> a callable building the model (ValueError naming what is wrong)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"expected MODULE:FACTORY, got {spec!r}")
    obj = getattr(importlib.import_module(module), name, None)
    if not callable(obj):
        raise ValueError(f"{spec!r}: {name!r} is not a callable of module {module!r}")
    return obj  # type: ignore[no-any-return]  # any callable; its result is checked by plan()


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"a shape is comma-separated positive ints, got {text!r}") from None
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"a shape is comma-separated positive ints, got {text!r}")
    return dims


def synthetic_batch(model: nn.Module, batch_shape: tuple[int, ...], targets_shape: tuple[int, ...] | None,
                    loss: str) -> tuple[tuple[torch.Tensor, torch.Tensor], LossFn]:
    """A seeded random batch of the given shapes and its loss: class labels below the model's output
    width for cross-entropy (one forward on one sample finds it), normal targets for MSE."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_shape, generator=g)
    if loss == "mse":
        return (x, torch.randn(targets_shape or batch_shape[:1], generator=g)), nn.functional.mse_loss
    with torch.no_grad():
        classes = int(model.eval()(x[:1]).shape[-1])
    model.train()
    return (x, torch.randint(0, classes, targets_shape or batch_shape[:1], generator=g)), nn.functional.cross_entropy


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(list(argv or []))
    try:  # every rank parses the same arguments: the same refusal everywhere, before any message
        factory = load_factory(args.factory)
        shape = _shape(args.batch_shape)
        targets = _shape(args.targets_shape) if args.targets_shape else None
        limit = parse_bytes(args.memory_limit) if args.memory_limit else None
    except (ValueError, ImportError) as e:
        print(f"mpitrain plan: {e}", flush=True)
        return 2
    comm = init()
    torch.manual_seed(0)
    model = factory()
    batch, loss_fn = synthetic_batch(model, shape, targets, args.loss)
    names = args.strategies.split(",") if args.strategies else None
    try:
        plans = plan(model, batch, loss_fn, comm=comm, memory_limit=limit, strategies=names, exact=args.exact,
                     cache=not args.no_cache, world_size=args.world_size)
    except PlanError as e:
        if comm.rank == 0:
            print(f"mpitrain plan: {e}", flush=True)
        return 2
    measured: list[float] = []
    for p in plans[:args.measure] if all(p.measured for p in plans) else []:  # plans for other ranks cannot run here
        measured.append(measure_plan(lambda: (torch.manual_seed(0), factory())[1], p, batch, loss_fn, comm,
                                     steps=args.steps))
    if comm.rank == 0:
        if args.json:
            print(json.dumps({"plans": [p.to_dict() for p in plans], "measured_step_s": measured,
                              "dropped": [d.describe() for d in plans.dropped]}, indent=1))
        else:
            ranks = comm.size if args.world_size is None else args.world_size
            print(f"# mpitrain plan {args.factory} for {ranks} ranks, batch {shape}: fastest predicted first")
            print(plans.table())
            for i, (p, t) in enumerate(zip(plans, measured)):
                print(f"measured #{i} {p.describe()}: {t * 1e3:.1f} ms/step, predicted {p.step_s * 1e3:.1f} "
                      f"(predicted/measured {p.step_s / t:.2f})")
            if args.explain:
                print(plans.explanation())
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
