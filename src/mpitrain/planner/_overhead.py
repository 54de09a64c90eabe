"""The runtime's own seconds per step that no formula of :mod:`mpitrain.perf` has: thread hand-offs,
Python per message, polling. Measured once per (machine, world size) by running each strategy on a
probe model whose compute and bytes are negligible; what the probe's step takes beyond its predicted
compute is the strategy's overhead, added to every plan of that strategy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..comm.base import Communicator
from ._types import Plan

__all__ = ["Overheads", "measure_overheads", "probe_model"]

#: Micro-batches of the probe pipeline (its per-slot overhead is its overhead / (M + P - 1)).
PROBE_M = 4


@dataclass(frozen=True)
class Overheads:
    """Seconds per step beyond the cost model, per strategy: `data`; `pipe_sgd[K-1]` for K = 1, 2;
    `pipeline_slot` per pipeline slot (a step has M + P - 1); `spatial_conv` per spatially split conv."""

    data: float = 0.0
    pipe_sgd: tuple[float, float] = (0.0, 0.0)
    pipeline_slot: float = 0.0
    spatial_conv: float = 0.0


def probe_model() -> nn.Module:
    """Two 1x1 convs on 2 channels and a linear head: fx-traceable, spatially convertible, ~20 parameters."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 2, 1), nn.ReLU(), nn.Conv2d(2, 2, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(2, 2))


def measure_overheads(comm: Communicator, timer: Callable[[Plan, tuple[torch.Tensor, torch.Tensor]], float]
                      ) -> Overheads:
    """Time the probe under data, pipe-sgd (K = 1, 2), model (P = W, M = 4) and spatial (grid (W, 1))
    with `timer(plan, batch)` (collective, the same seconds on every rank); the probe's compute is
    timed alone on this rank and subtracted. Collective over `comm`."""
    W = comm.size
    if W == 1:
        return Overheads()
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(W * PROBE_M, 2, 4 * W, 4 * W, generator=g), torch.randint(0, 2, (W * PROBE_M,), generator=g))
    model, loss = probe_model(), nn.functional.cross_entropy

    def alone() -> float:
        from ..perf.calibrate import best_time

        def step() -> None:
            model.zero_grad()
            loss(model(batch[0]), batch[1]).backward()

        return best_time(step, 5)

    base = alone()

    def over(p: Plan) -> float:
        return max(timer(p, batch) - base / W, 0.0)

    data = over(Plan("data", {}, 0.0, 0))
    pipe = (over(Plan("pipe-sgd", {"staleness": 1}, 0.0, 0)), over(Plan("pipe-sgd", {"staleness": 2}, 0.0, 0)))
    slot = over(Plan("model", {"partitions": W, "micro_batches": PROBE_M}, 0.0, 0)) / (PROBE_M + W - 1)
    conv = over(Plan("spatial", {"grid": (W, 1), "samples": 1}, 0.0, 0)) / 2
    out = torch.tensor([data, *pipe, slot, conv], dtype=torch.float64)
    comm.allreduce(out, op="max")
    v = out.tolist()
    return Overheads(v[0], (v[1], v[2]), v[3], v[4])
