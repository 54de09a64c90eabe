"""Spatially parallel Conv2d: halo exchange overlapped with the interior, exact forward and backward.

Forward (§IV-A): post the halo messages, convolve the interior (outputs whose windows read only local
cells and padding) while they fly, then the boundary strips. Backward: dL/dx of the halo-extended block
first, its halo parts go back to their owners while dL/dw is computed, then the received parts are added.
Only the local block and the (thin) received halos are saved for backward; the extended block is
rebuilt there, so activation memory is the single-process memory divided by the grid.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import settle_on_error
from ..comm.base import Communicator
from ._exchange import (
    BACKWARD_TAG,
    Exchange,
    HaloStats,
    SendQueue,
    assemble,
    assemble_box,
    finish_adjoint,
    finish_exchange,
    isend_all,
    outstanding,
    place_halos,
    settle,
    start_adjoint,
    start_exchange,
)
from ._memory import dense, empty_as
from ._window import PADDING_MODES, WindowLayer, input_layout, pad_by_mode, padding_mode_problem
from .distribution import Distribution
from .halo import Box, HaloPlan, Window, halo_exchange, window_of
from .tensor import DistributionLike, SpatialError

__all__ = ["SpatialConv2d", "interior"]


def _interior_1d(need: tuple[int, int], owned: tuple[int, int], valid: int, count: int, w: Window
                 ) -> tuple[int, int]:
    """Local output indices ``[lo, hi)`` whose windows read no halo cell along one dimension."""
    a, b = need
    q, r = owned
    lo = math.ceil((q - a) / w.stride) if max(a, 0) < q else 0
    hi = (r - a - w.span) // w.stride + 1 if r < min(b, valid) else count
    lo = min(max(0, lo), count)
    return lo, max(lo, min(count, hi))


def interior(plan: HaloPlan, windows: tuple[Window, Window]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Local (rows, cols) output ranges computable before any halo arrives (pure; may be empty)."""
    oh, ow = plan.out.shape
    rows = _interior_1d(plan.need.rows, plan.owned.rows, plan.valid.rows[1], oh, windows[0])
    cols = _interior_1d(plan.need.cols, plan.owned.cols, plan.valid.cols[1], ow, windows[1])
    return rows, cols


def _regions(oh: int, ow: int, rows: tuple[int, int], cols: tuple[int, int]
             ) -> list[tuple[int, int, int, int]]:
    """The boundary strips around the interior: (r0, r1, c0, c1) output regions, non-empty only."""
    (r0, r1), (c0, c1) = rows, cols
    parts = [(0, r0, 0, ow), (r1, oh, 0, ow), (r0, r1, 0, c0), (r0, r1, c1, ow)]
    return [p for p in parts if p[1] > p[0] and p[3] > p[2]]


def _aligned(plan: HaloPlan, windows: tuple[Window, Window]) -> bool:
    """Whether torch's own symmetric padding on the bare local block yields exactly this rank's output
    block (then only the boundary strips that read halos need recomputing)."""
    dims = zip(windows, (plan.need.rows, plan.need.cols), (plan.owned.rows, plan.owned.cols),
               (plan.out.rows, plan.out.cols))
    for w, need, owned, out in dims:
        if w.pad[0] != w.pad[1] or need[0] != owned[0] - w.pad[0]:
            return False
        if w.out_size(owned[1] - owned[0]) != out[1] - out[0]:
            return False
    return True


def _input_box(plan: HaloPlan, windows: tuple[Window, Window], region: tuple[int, int, int, int]) -> Box:
    """Global input cells read by the local output `region` (r0, r1, c0, c1)."""
    r0, r1, c0, c1 = region
    (wh, ww), a, c = windows, plan.need.rows[0], plan.need.cols[0]
    return Box((a + r0 * wh.stride, a + (r1 - 1) * wh.stride + wh.span),
               (c + c0 * ww.stride, c + (c1 - 1) * ww.stride + ww.span))


def _strips(plan: HaloPlan, windows: tuple[Window, Window]) -> list[tuple[tuple[int, int, int, int], Box]]:
    """Output regions that read halo cells, with the input box each reads."""
    if not plan.recvs:
        return []
    rows, cols = interior(plan, windows)
    oh, ow = plan.out.shape
    return [(r, _input_box(plan, windows, r)) for r in _regions(oh, ow, rows, cols)]


class _Conv(torch.autograd.Function):
    """Three paths, chosen per plan: "direct" (the block is all the layer reads), "implicit" (torch pads
    the bare block; halo-reading strips are recomputed from thin assembled strips: no full-size copy)
    and "extended" (the halo-extended block is assembled; any geometry)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: SpatialConv2d,
                plan: HaloPlan, comm: Communicator, queue: SendQueue) -> torch.Tensor:
        ctx.layer, ctx.plan, ctx.comm, ctx.has_bias, ctx.queue = layer, plan, comm, bias is not None, queue
        ctx.mode, strips = layer.geometry(plan)
        if ctx.mode == "extended":
            x = dense(x)  # the other paths read the block in place (e.g. a view from scatter)
        ex = start_exchange(x, plan, comm) if plan.exchanges else None
        with settle_on_error(lambda: outstanding(ex)):  # an exception leaves no receive posted
            if ctx.mode == "extended":
                y, halos = _forward_extended(x, weight, bias, layer, plan, ex, queue)
            else:
                y = layer.conv(x, weight, bias, layer.pads if ctx.mode == "implicit" else [0, 0])
                halos = _wait(ex, plan, layer.stats, queue)
                for (r0, r1, c0, c1), box in strips:
                    y[:, :, r0:r1, c0:c1] = layer.conv(assemble_box(x, plan, halos, box, 0.0), weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.halos = halos
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dy = dense(dy)
        if ctx.mode == "extended":
            return (*_backward_extended(ctx, x, weight, dy), None, None, None, None)
        layer, plan = ctx.layer, ctx.plan
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        pads = layer.pads if ctx.mode == "implicit" else [0, 0]
        strips = layer.geometry(plan)[1]
        ex, dw_halo = _strip_backward(x, weight, dy, layer, plan, ctx.halos, strips, ctx.comm, need_x, need_w)
        with settle_on_error(lambda: outstanding(ex)):
            bias_sizes = [weight.shape[0]] if ctx.has_bias else None
            dx, dw, db = torch.ops.aten.convolution_backward(
                dy, x, weight, bias_sizes, layer.stride, pads, layer.dilation, False, [0, 0], layer.groups,
                [need_x, need_w, need_b])
            for part in dw_halo:  # by linearity: what the halo cells (zero in the padded bare block) add
                dw += part
            if ex is not None:
                t0 = time.perf_counter()
                _add_received(dx, plan, ex, ctx.queue)
                layer.stats.wait_s += time.perf_counter() - t0
        return dx, dw, db, None, None, None, None


def _strip_backward(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, layer: SpatialConv2d, plan: HaloPlan,
                    halos: list[torch.Tensor], strips: list[tuple[tuple[int, int, int, int], Box]],
                    comm: Communicator, need_x: bool, need_w: bool
                    ) -> tuple[Exchange | None, list[torch.Tensor]]:
    """The halo cells' share of the backward, one small convolution backward per strip on the strip's
    halo cells only (local cells zero): their gradients go back to their owners (receives are posted
    for the gradients of this block's cells that other ranks read), and their dL/dw contributions are
    returned to be added to the bare block's. dL/d(input) of a convolution does not depend on the
    input's values, so one call gives both; the bare-block backward already gives every local cell its
    whole gradient from this rank's outputs (the conv is linear in its input)."""
    if not (need_x or need_w) or not plan.exchanges:  # no halo: nothing to send, receive or add
        return None, []
    grads = [empty_as(x, (x.shape[0], x.shape[1], *box.shape)).zero_() for _, box in plan.recvs] if need_x else []
    dw_parts = []
    for (r0, r1, c0, c1), box in strips:
        only_halo = assemble_box(x, plan, halos, box, 0.0, local=False)
        dsub, dw_part, _ = torch.ops.aten.convolution_backward(
            dense(dy[:, :, r0:r1, c0:c1]), only_halo, weight, None, layer.stride, [0, 0],
            layer.dilation, False, [0, 0], layer.groups, [need_x, need_w, False])
        if need_w:
            dw_parts.append(dw_part)
        for (_, rbox), g in zip(plan.recvs, grads):
            part = rbox & box
            if not part.empty:
                g[(..., *part.within(rbox))] += dsub[(..., *part.within(box))]
    if not need_x:
        return None, dw_parts
    parts = [x.new_empty((x.shape[0], x.shape[1], *box.shape)) for _, box in plan.sends]
    reqs = [comm.irecv(buf, dst, BACKWARD_TAG) for (dst, _), buf in zip(plan.sends, parts)]
    sends = isend_all(comm, [(g, src) for (src, _), g in zip(plan.recvs, grads)], BACKWARD_TAG)
    return Exchange(parts, reqs, sends), dw_parts


def _add_received(dx: torch.Tensor, plan: HaloPlan, ex: Exchange, queue: SendQueue) -> None:
    settle(ex, plan, queue, backward=True)
    for (_, box), part in zip(plan.sends, ex.halos):
        dx[(..., *box.within(plan.owned))] += part


def _forward_extended(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: SpatialConv2d,
                      plan: HaloPlan, ex: Exchange | None, queue: SendQueue
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ext = assemble(x, plan, (), 0.0)
    oh, ow = plan.out.shape
    rows, cols = interior(plan, layer.windows)
    split = layer.overlap and ex is not None and rows[1] > rows[0] and cols[1] > cols[0]
    y = empty_as(x, (x.shape[0], weight.shape[0], oh, ow)) if split else None
    if y is not None:
        layer.region(y, ext, weight, bias, (*rows, *cols))
    halos = _wait(ex, plan, layer.stats, queue)
    place_halos(ext, plan, halos)
    if y is not None:
        for region in _regions(oh, ow, rows, cols):
            layer.region(y, ext, weight, bias, region)
    else:
        y = layer.conv(ext, weight, bias)
    return y, halos


def _backward_extended(ctx: Any, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    layer, plan = ctx.layer, ctx.plan
    ext = assemble(x, plan, ctx.halos, 0.0)
    dx = dw = db = None
    args = (layer.stride, [0, 0], layer.dilation, False, [0, 0], layer.groups)
    ex = None
    if ctx.needs_input_grad[0]:
        dext = torch.ops.aten.convolution_backward(dy, ext, weight, None, *args, [True, False, False])[0]
        ex = start_adjoint(dext, plan, ctx.comm) if plan.exchanges else None
    with settle_on_error(lambda: outstanding(ex)):
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            bias_sizes = [weight.shape[0]] if ctx.has_bias else None
            mask = [False, ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
            _, dw, db = torch.ops.aten.convolution_backward(dy, ext, weight, bias_sizes, *args, mask)
        if ctx.needs_input_grad[0]:
            t0 = time.perf_counter()
            dx = finish_adjoint(dext, plan, ex, ctx.queue) if ex is not None else _crop(dext, plan)
            layer.stats.wait_s += time.perf_counter() - t0
    return dx, dw, db


def _crop(dext: torch.Tensor, plan: HaloPlan) -> torch.Tensor:
    dx = empty_as(dext, (*dext.shape[:2], *plan.owned.shape)).zero_()
    if not plan.local.empty:
        dx[(..., *plan.local.within(plan.owned))] = dext[(..., *plan.local.within(plan.need))]
    return dx


def _wait(ex: Exchange | None, plan: HaloPlan, stats: HaloStats, queue: SendQueue) -> list[torch.Tensor]:
    if ex is None:
        return []
    t0 = time.perf_counter()
    halos = finish_exchange(ex, plan, queue)
    stats.wait_s += time.perf_counter() - t0
    stats.exchanges += 1
    return halos


class SpatialConv2d(WindowLayer):
    """The spatially parallel form of `conv` (any kernel, stride, padding incl. "same", dilation, groups,
    bias), sharing its parameters. Takes and returns local blocks; output, dL/dx and the local dL/dw are
    those of the single-process layer (dL/dw is this rank's partial sum: :func:`parallelize` sums it).

    ``overlap=True`` computes the interior while halos are in flight; ``stats`` counts the seconds still
    spent waiting for them."""

    def __init__(self, conv: nn.Conv2d, dist: Distribution, overlap: bool = True) -> None:
        if conv.padding_mode not in PADDING_MODES:
            raise SpatialError(f"SpatialConv2d: padding_mode {conv.padding_mode!r} has no spatial form")
        super().__init__(dist, window_of(conv.kernel_size, conv.stride, conv.padding, conv.dilation))
        self.weight, self.bias = conv.weight, conv.bias
        self.stride, self.dilation, self.groups = list(conv.stride), list(conv.dilation), conv.groups
        self.overlap, self.padding_mode = overlap, conv.padding_mode
        self.pads = [w.pad[0] for w in self.windows]
        self.source = repr(conv)
        self._geometry: dict[int, tuple[HaloPlan, str, list]] = {}

    def geometry(self, plan: HaloPlan) -> tuple[str, list[tuple[tuple[int, int, int, int], Box]]]:
        """(path, halo-reading strips) for `plan` (see :class:`_Conv`), computed once per plan."""
        hit = self._geometry.get(id(plan))
        if hit is None or hit[0] is not plan:
            mode = "direct" if plan.need == plan.owned else (
                "implicit" if _aligned(plan, self.windows) else "extended")
            hit = self._geometry[id(plan)] = (plan, mode, _strips(plan, self.windows))
        return hit[1], hit[2]

    def extra_repr(self) -> str:
        return f"{self.source}, grid={self.dist.grid}, overlap={self.overlap}"

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             padding: list[int] | int = 0) -> torch.Tensor:
        return F.conv2d(x, weight, bias, self.stride, padding, self.dilation, self.groups)

    def region(self, y: torch.Tensor, ext: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               region: tuple[int, int, int, int]) -> None:
        """Compute output rows [r0, r1) x cols [c0, c1) of `y` from the extended block `ext`."""
        r0, r1, c0, c1 = region
        (wh, ww), (sh, sw) = self.windows, self.stride
        part = ext[:, :, r0 * sh:(r1 - 1) * sh + wh.span, c0 * sw:(c1 - 1) * sw + ww.span]
        y[:, :, r0:r1, c0:c1] = self.conv(part, weight, bias)

    def check_plans(self, plans: list[HaloPlan], grid: tuple[int, ...]) -> None:
        mode = self.padding_mode
        problem = padding_mode_problem(plans, mode, grid) if mode != "zeros" else None
        if problem:
            raise SpatialError(problem)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, layout = input_layout(self, x)
        if layout.kind == "replicated":
            pads = [p for w in reversed(self.windows) for p in w.pad]
            padded = F.pad(x, pads, mode="constant" if self.padding_mode == "zeros" else self.padding_mode)
            y = F.conv2d(padded, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)
            return self.tag_output(y, layout)
        plan = self.plan(layout, x)
        if self.padding_mode != "zeros":  # the halo then torch's padding rule on the needed box
            ext = halo_exchange(x, plan, layout.dist.spatial_comm, 0.0, layout.dist.sends)
            ext = pad_by_mode(ext, plan, self.padding_mode)
            return self.tag_output(self.conv(ext, self.weight, self.bias), layout)
        mode, _ = self.geometry(plan)
        if plan.exchanges or mode == "extended":
            y = _autocast_conv(x, self.weight, self.bias, self, plan, layout.dist)
        else:  # this block reads no other rank's cells: the torch layer on it, with torch's own autograd
            y = self.conv(x, self.weight, self.bias, self.pads if mode == "implicit" else 0)
        return self.tag_output(y, layout)


def _autocast_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: SpatialConv2d,
                   plan: HaloPlan, dist: DistributionLike) -> torch.Tensor:
    """:class:`_Conv` as autocast would run ``F.conv2d``: under autocast for the block's device type the
    block, weight and bias are cast to its dtype first (autograd casts the gradients back to the
    parameters' dtype) and the custom function runs on them without autocast (its backward would
    otherwise mix dtypes)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and torch.float64 not in (x.dtype, weight.dtype):  # as autocast
        low = torch.get_autocast_dtype(dev)
        with torch.autocast(dev, enabled=False):
            cast: torch.Tensor = _Conv.apply(x.to(low), weight.to(low), None if bias is None else bias.to(low),
                                             layer, plan, dist.spatial_comm, dist.sends)
        return cast
    out: torch.Tensor = _Conv.apply(x, weight, bias, layer, plan, dist.spatial_comm, dist.sends)
    return out
