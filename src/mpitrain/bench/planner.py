"""The planner's predictions against measured steps: prediction error, regret and the chosen plan.

``mpitrain bench planner -n 2``. For each workload (a compute-heavy CNN, a wide MLP, the mesh model,
a small transformer, ResNet-18 at 224^2; batches shrunk so that a run takes minutes) it plans, runs
the top plans (distinct layouts: pipe-sgd's codecs count as one unless ``--all-codecs``) for a few
steps each, and prints predicted vs measured seconds per step. Error: |predicted - measured| /
measured. Regret: the measured step of plan[0] over the best measured step among the plans run
(1.0: the planner's first choice was the fastest it ran). ``--plot FILE.png``: predicted vs measured.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..comm.base import Communicator
from ..planner import Plan, measure_plan, plan
from ..runtime import init
from ..spatial.mesh import mesh_batch, mesh_model
from .common import header, print_table

__all__ = ["main", "WORKLOADS", "Workload"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """A model factory (seeded: the same weights on every rank) and one global batch."""

    what: str
    model: Callable[[], nn.Module]
    batch: Callable[[], Batch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return make()
    return build


def _images(n: int, c: int, hw: int, classes: int) -> Callable[[], Batch]:
    def make() -> Batch:
        g = torch.Generator().manual_seed(1)
        return torch.randn(n, c, hw, hw, generator=g), torch.randint(0, classes, (n,), generator=g)
    return make


def _cnn() -> nn.Module:
    """Compute-heavy: 3x3 convs of 64-128 channels on 32^2, few parameters per FLOP."""
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(128, 10))


def _mlp() -> nn.Module:
    """Wide: 21 MB of parameters, little compute per parameter."""
    return nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


def _mlp_batch() -> Batch:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 512, generator=g), torch.randint(0, 10, (32,), generator=g)


class _Transformer(nn.Module):
    """Two pre-norm encoder layers (d=128, 4 heads, 64 tokens), mean-pooled into a classifier."""

    def __init__(self, vocab: int = 1000, d: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.Sequential(*(nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True,
                                                                 norm_first=True) for _ in range(layers)))
        self.head = nn.Linear(d, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.layers(self.embed(tokens)).mean(dim=1))
        return out


def _tokens() -> Batch:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 1000, (16, 64), generator=g), torch.randint(0, 10, (16,), generator=g)


def _resnet() -> nn.Module:
    from ..spatial.models import torchvision_module  # torchvision without its C++ ops

    model: nn.Module = torchvision_module("models.resnet").resnet18(num_classes=10)
    return model


#: name -> workload (batches shrunk from the issue's so that a run takes minutes on a small machine)
WORKLOADS: dict[str, Workload] = {
    "cnn": Workload("compute-heavy CNN, 32x3x32x32", _seeded(_cnn), _images(32, 3, 32, 10)),
    "mlp": Workload("wide MLP 512-2048-2048-10, batch 32", _seeded(_mlp), _mlp_batch),
    "mesh": Workload("mesh model, 1x18x1024x1024", _seeded(lambda: mesh_model()), lambda: mesh_batch(1, 1024)),
    "transformer": Workload("2-layer transformer d=128, 16x64 tokens", _seeded(_Transformer), _tokens),
    "resnet": Workload("ResNet-18, 4x3x224x224", _seeded(_resnet), _images(4, 3, 224, 10)),
}


def _layout(p: Plan, all_codecs: bool) -> tuple[object, ...]:
    opts = {k: v for k, v in p.options.items() if all_codecs or k != "compression"}
    return (p.strategy, tuple(sorted((k, repr(v)) for k, v in opts.items())))


def run_workload(comm: Communicator, name: str, top: int, steps: int, all_codecs: bool) -> list[list[object]]:
    """Rows [workload, rank, plan, predicted ms, measured ms, error] for the top distinct plans."""
    w = WORKLOADS[name]
    batch = w.batch()
    plans = plan(w.model(), batch, w.loss, comm=comm, cache=False)
    chosen: list[tuple[int, Plan]] = []
    seen: set[tuple[object, ...]] = set()
    for i, p in enumerate(plans):
        key = _layout(p, all_codecs)
        if key not in seen:
            seen.add(key)
            chosen.append((i, p))
        if len(chosen) == top:
            break
    rows: list[list[object]] = []
    for i, p in chosen:
        t = measure_plan(w.model, p, batch, w.loss, comm, steps=steps, warmup=1)
        rows.append([name, i, p.describe(), p.step_s * 1e3, t * 1e3, abs(p.step_s - t) / t])
    return rows


def _plot(rows: Sequence[Sequence[object]], path: str, ranks: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    for name in dict.fromkeys(str(r[0]) for r in rows):
        pts = [(float(r[4]), float(r[3])) for r in rows if r[0] == name]  # type: ignore[arg-type]
        ax.scatter([m for m, _ in pts], [p for _, p in pts], label=name)
    lo = min(min(float(r[3]), float(r[4])) for r in rows) / 1.5  # type: ignore[arg-type]
    hi = max(max(float(r[3]), float(r[4])) for r in rows) * 1.5  # type: ignore[arg-type]
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="grey", alpha=0.2,
                    label="within 25%")
    ax.set(xscale="log", yscale="log", xlabel="measured ms/step", ylabel="predicted ms/step",
           title=f"mpitrain planner: predicted vs measured, {ranks} ranks")
    ax.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mpitrain bench planner", description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated names (default: all)")
    p.add_argument("--top", type=int, default=4, help="distinct plans measured per workload")
    p.add_argument("--steps", type=int, default=3, help="timed steps per plan (median)")
    p.add_argument("--all-codecs", action="store_true", help="measure each pipe-sgd compression separately")
    p.add_argument("--plot", help="write predicted vs measured to this PNG (rank 0)")
    args = p.parse_args(list(argv or []))
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    comm = init()
    rows: list[list[object]] = []
    for name in names:
        got = run_workload(comm, name, args.top, args.steps, args.all_codecs)
        rows += got
        if comm.rank == 0:
            print_table(["workload", "#", "plan", "predicted ms", "measured ms", "error"], got)
    if comm.rank == 0:
        print(header("planner: predicted vs measured step per plan", comm.size))
        print_table(["workload", "#", "plan", "predicted ms", "measured ms", "error"], rows)
        summary = []
        for name in names:
            mine = [r for r in rows if r[0] == name]
            best = min(float(r[4]) for r in mine)  # type: ignore[arg-type]
            summary.append([name, WORKLOADS[name].what, mine[0][2], float(mine[0][4]) / best])  # type: ignore[arg-type]
        within = sum(1 for r in rows if float(r[5]) <= 0.25) / len(rows)  # type: ignore[arg-type,misc]
        print_table(["workload", "what", "plan[0]", "regret"], summary)
        print(f"# predictions within 25% of measured: {within:.0%} of {len(rows)}; "
              f"worst regret {max(float(s[3]) for s in summary):.2f}")
        if args.plot:
            _plot(rows, args.plot, comm.size)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
