"""The paper's §V-A cost model of spatially parallel convolution: empirical local conv times plus
analytic halo send/recv (alpha + beta n) and ring-allreduce terms, summed over a network's convs."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .calibrate import best_time
from .timing import ring_allreduce_time

__all__ = ["ConvShape", "LayerCost", "halo_messages", "layer_cost", "predict", "conv_shapes",
           "time_local_conv", "ring_allreduce", "layer_path"]


@dataclass(frozen=True)
class ConvShape:
    """One conv layer: global input (n, c, h, w), f filters, k x k kernel, stride."""

    n: int
    c: int
    h: int
    w: int
    f: int
    k: int
    stride: int = 1

    def local(self, grid: tuple[int, int], samples: int) -> tuple[int, int, int, int]:
        """The largest block (n, c, h, w) a rank holds (the slowest rank bounds a step)."""
        return (math.ceil(self.n / samples), self.c, math.ceil(self.h / grid[0]), math.ceil(self.w / grid[1]))


@dataclass(frozen=True)
class LayerCost:
    """Seconds: forward, backward dL/dx, backward dL/dw, gradient allreduce, and their overlapped sum."""

    fp: float
    bpx: float
    bpw: float
    bpa: float
    total: float


def halo_messages(shape: ConvShape, grid: tuple[int, int], samples: int, itemsize: int = 4
                  ) -> list[tuple[int, int]]:
    """(count, bytes) of the halo messages one rank sends per exchange, as in the paper: 2 east/west of
    O*N*C*I_H, 2 north/south of O*N*C*I_W, 4 corners of O^2*N*C (O = k // 2); none along an unsplit
    dimension."""
    o = shape.k // 2
    n, c, ih, iw = shape.local(grid, samples)
    out = []
    if grid[1] > 1:
        out.append((2, o * n * c * ih * itemsize))
    if grid[0] > 1:
        out.append((2, o * n * c * iw * itemsize))
    if grid[0] > 1 and grid[1] > 1:
        out.append((4, o * o * n * c * itemsize))
    return [(k, b) for k, b in out if b]


def ring_allreduce(p: int, nbytes: int, alpha: float, beta: float) -> float:
    """§V-A's BPa: the ring allreduce of :func:`~mpitrain.perf.timing.ring_allreduce_time` (Pipe-SGD
    eqs. 5-6, the one copy of the formula) without the summing term, as the paper writes it."""
    return ring_allreduce_time(nbytes, p, alpha, beta, 0.0)


def layer_cost(shape: ConvShape, grid: tuple[int, int], samples: int, compute: tuple[float, float, float],
               alpha: float, beta: float, overlap: bool = True) -> LayerCost:
    """§V-A: FP = C + halo, BPx = Cx + halo, BPw = Cw, BPa = AR(P, F*C*K^2). With `overlap`, the forward
    halo hides behind the forward compute and the backward halo behind dL/dw (the paper's two overlaps)."""
    fp, bpx, bpw = compute
    halo = sum(k * (alpha + beta * b) for k, b in halo_messages(shape, grid, samples))
    bpa = ring_allreduce(samples * grid[0] * grid[1], shape.f * shape.c * shape.k ** 2 * 4, alpha, beta)
    if overlap:
        total = max(fp, halo) + bpx + max(bpw, halo) + bpa
    else:
        total = fp + halo + bpx + halo + bpw + bpa
    return LayerCost(fp + halo, bpx + halo, bpw, bpa, total)


def predict(shapes: Sequence[ConvShape], grid: tuple[int, int], samples: int,
            compute: Callable[[ConvShape], tuple[float, float, float]], alpha: float, beta: float,
            overlap: bool = True) -> float:
    """Predicted seconds of the convolutions of one training step (other layers are treated as free, as
    in the paper's §V-B)."""
    return sum(layer_cost(s, grid, samples, compute(s), alpha, beta, overlap).total for s in shapes)


def conv_shapes(model: torch.nn.Module, input_shape: tuple[int, ...]) -> list[ConvShape]:
    """The ConvShape of every Conv2d of `model` for an input of `input_shape` (one pass of a meta-device
    copy: no compute, `model` untouched; the input takes the dtype of the model's first parameter)."""
    shapes: list[ConvShape] = []

    def hook(m: torch.nn.Module, args: tuple[torch.Tensor, ...], _out: object) -> None:
        assert isinstance(m, torch.nn.Conv2d)  # the hook is registered on Conv2d layers only
        n, c, h, w = args[0].shape
        shapes.append(ConvShape(n, c, h, w, m.out_channels, m.kernel_size[0], m.stride[0]))

    meta = copy.deepcopy(model).to("meta")
    for m in meta.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(hook)
    dtype = next((p.dtype for p in meta.parameters() if p.is_floating_point()), torch.get_default_dtype())
    with torch.no_grad():
        meta(torch.empty(input_shape, device="meta", dtype=dtype))
    return shapes


def time_local_conv(shape: ConvShape, grid: tuple[int, int], samples: int, repeats: int = 1
                    ) -> tuple[float, float, float]:
    """Measured seconds of this rank's forward, dL/dx and dL/dw of one conv on the largest local block
    (the paper's empirical C, Cx, Cw)."""
    n, c, h, w = shape.local(grid, samples)
    pad = shape.k // 2
    x, wt = torch.randn(n, c, h + 2 * pad, w + 2 * pad), torch.randn(shape.f, c, shape.k, shape.k)
    y = F.conv2d(x, wt, None, shape.stride)
    dy = torch.randn_like(y)
    args = (None, [shape.stride] * 2, [0, 0], [1, 1], False, [0, 0], 1)

    return (best_time(lambda: F.conv2d(x, wt, None, shape.stride), repeats),
            best_time(lambda: torch.ops.aten.convolution_backward(dy, x, wt, *args, [True, False, False]), repeats),
            best_time(lambda: torch.ops.aten.convolution_backward(dy, x, wt, *args, [False, True, False]), repeats))


def layer_path(costs: Sequence[Sequence[float]], shuffle: Callable[[int, int, int], float]
               ) -> tuple[float, list[int]]:
    """§V-C: the fastest assignment of one candidate distribution per layer of a line network.

    ``costs[i][d]``: Cost_D(l_i), seconds of layer i under distribution d (inf: not possible);
    ``shuffle(i, d, e)``: Shuffle(D, E), seconds to redistribute layer i's output from d to e. The
    graph has a vertex per (layer, distribution), edges ``(i, d) -> (i+1, e)`` weighted
    ``Cost_d(l_i) + Shuffle(d, e)``, and the shortest source-to-sink path is found in one sweep (a DAG).
    Returns (seconds, distribution index per layer); ties go to the lower index, so every rank given
    the same costs takes the same path."""
    if not costs:
        return 0.0, []
    inf = float("inf")
    best = list(costs[0])
    back: list[list[int]] = []
    for i in range(1, len(costs)):
        row, arg = [], []
        for e, c in enumerate(costs[i]):
            cands = [best[d] + shuffle(i - 1, d, e) for d in range(len(best))]
            k = min(range(len(cands)), key=lambda j: cands[j])
            row.append(cands[k] + c if c < inf else inf)
            arg.append(k)
        best, back = row, [*back, arg]
    d = min(range(len(best)), key=lambda j: best[j])
    total, path = best[d], [d]
    for arg in reversed(back):
        d = arg[d]
        path.append(d)
    return total, path[::-1]
