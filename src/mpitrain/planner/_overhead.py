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
#: Hidden width of the large probe: two Linear layers of 2 x 2^18 weights, 4 MiB of gradients.
BIG_HIDDEN = 1 << 18

Timer = Callable[[Callable[[], nn.Module], Plan, tuple[torch.Tensor, torch.Tensor]], float]


@dataclass(frozen=True)
class Overheads:
    """Seconds per step beyond the cost model, per strategy: `data` and `pipe_sgd[K-1]` (K = 1, 2) as
    (seconds, seconds per gradient byte); `pipeline_slot` per pipeline slot (a step has M + P - 1);
    `spatial_conv` per spatially split conv."""

    data: tuple[float, float] = (0.0, 0.0)
    pipe_sgd: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))
    pipeline_slot: float = 0.0
    spatial_conv: float = 0.0

    def of_data(self, nbytes: float) -> float:
        return self.data[0] + self.data[1] * nbytes

    def of_pipe_sgd(self, K: int, nbytes: float) -> float:
        fixed, per_byte = self.pipe_sgd[min(K, 2) - 1]
        return fixed + per_byte * nbytes


def probe_model(hidden: int = 2) -> nn.Module:
    """Two 3x3 convs on 2 channels (halo exchanges when split) and a 2-`hidden`-2 linear head:
    fx-traceable, spatially convertible; ~100 parameters at the default `hidden`, 4 MiB of them at
    :data:`BIG_HIDDEN`, with no compute to speak of either way."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(2, hidden), nn.Linear(hidden, 2))


def _alone(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    from ..perf.calibrate import best_time

    def step() -> None:
        model.zero_grad()
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()

    return best_time(step, 5)


def measure_overheads(comm: Communicator, timer: Timer, comm_formula: Callable[[float], float]) -> Overheads:
    """Time two probes (small, and with 4 MiB of gradients) under data, pipe-sgd (K = 1, 2), and the
    small one under model (P = W, M = 4) and spatial (grid (W, 1)), with `timer(make_model, plan,
    batch)` (collective, the same seconds on every rank). Each probe's compute alone on this rank and
    `comm_formula(bytes)` (the cost model's gradient exchange) are subtracted; the rest, fitted as
    seconds + seconds per byte, is the overhead. Collective over `comm`."""
    W = comm.size
    if W == 1:
        return Overheads()
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(W * PROBE_M, 2, 4 * W, 4 * W, generator=g), torch.randint(0, 2, (W * PROBE_M,), generator=g))
    small, big = (lambda: probe_model()), (lambda: probe_model(BIG_HIDDEN))
    nbytes = [float(sum(p.numel() * 4 for p in f().parameters())) for f in (small, big)]
    # each rank's own compute: its share of the batch. Not the whole batch / W: a parameter-bound model
    # (the big probe, a wide MLP) does its per-parameter work (weight gradients, zeroing) on every rank
    # whatever its share, and that work must not be counted as per-byte overhead of the strategy
    share = (batch[0][:PROBE_M], batch[1][:PROBE_M])
    base = [_alone(f(), share) for f in (small, big)]

    def over(make: Callable[[], nn.Module], p: Plan, i: int = 0, formula: bool = True) -> float:
        return max(timer(make, p, batch) - base[i] - (comm_formula(nbytes[i]) if formula else 0.0), 0.0)

    fits = []
    for p in (Plan("data", {}, 0.0, 0), Plan("pipe-sgd", {"staleness": 1}, 0.0, 0),
              Plan("pipe-sgd", {"staleness": 2}, 0.0, 0)):
        lo, hi = over(small, p, 0), over(big, p, 1)
        fits += [lo, max(hi - lo, 0.0) / (nbytes[1] - nbytes[0])]
    slot = over(small, Plan("model", {"partitions": W, "micro_batches": PROBE_M}, 0.0, 0), formula=False)
    conv = over(small, Plan("spatial", {"grid": (W, 1), "samples": 1}, 0.0, 0), formula=False) / 2
    out = torch.tensor([*fits, slot / (PROBE_M + W - 1), conv], dtype=torch.float64)
    comm.allreduce(out, op="max")
    v = out.tolist()
    return Overheads((v[0], v[1]), ((v[2], v[3]), (v[4], v[5])), v[6], v[7])
