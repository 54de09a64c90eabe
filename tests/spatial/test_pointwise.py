"""Pointwise ops by torch's own tags: every aten op torch tags ``pointwise`` (unary, binary, with
scalars, with per-channel tensors broadcast against the block, in place) runs on the block with
nothing redistributed and equals one process; reductions that share a packet with a
pointwise overload (``max(x, 1)``) and ops that mix cells are not classed pointwise."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch._ops import OpOverloadPacket

from mpitrain.spatial import Distribution, gather
from mpitrain.spatial._pointwise import is_pointwise
from tests.helpers import assert_all_ranks

Case = tuple[str, Callable[..., torch.Tensor], list[str]]  # (label, function, operand kinds)


def _packets() -> Iterator[tuple[str, OpOverloadPacket]]:
    """Every aten packet registered with an overload tagged pointwise that returns tensors (260 tagged in
    torch 2.13, all but ``equal``, which returns one bool), but the backward ops."""
    names = sorted({s.name[len("aten::"):] for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::")})
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, OpOverloadPacket) or "backward" in name:
            continue
        ops = [getattr(packet, o) for o in packet.overloads()]
        if any(torch.Tag.pointwise in op.tags and all(str(r.type) == "Tensor" for r in op._schema.returns)
               for op in ops):
            yield name, packet


def _public(name: str, packet: OpOverloadPacket) -> Callable[..., torch.Tensor]:
    """The function a user calls (torch.special.erfcx, torch.sin, F.silu, Tensor.sin_), else the aten
    packet itself (silu_, hardsigmoid_ have no other name)."""
    if name.startswith("special_") and hasattr(torch.special, name[8:]):
        return getattr(torch.special, name[8:])
    for space in (torch, F, torch.Tensor):
        if hasattr(space, name):
            return getattr(space, name)
    return packet


def _operands(packet: OpOverloadPacket) -> list[str] | None:
    """The kinds of the required operands of the packet's first pointwise overload taking tensors:
    "x" (the block's tensor), "mask" (a bool tensor), "scalar", "int"."""
    for o in packet.overloads():
        op = getattr(packet, o)
        if torch.Tag.pointwise not in op.tags or o.endswith("out"):
            continue
        kinds = []
        for a in op._schema.arguments:
            if a.kwarg_only or (a.has_default_value() and a.name not in ("min",)):
                continue
            t = str(a.type)
            kinds.append("mask" if a.name in ("condition", "mask") else "x" if "Tensor" in t
                         else "int" if t == "int" else "scalar")
        if kinds and kinds[0] in ("x", "mask"):
            return kinds
    return None


def cases() -> list[Case]:
    """Per pointwise packet: all tensor operands blocks; blocks against per-channel tensors (C x 1 x 1)
    on either side; and Scalar operands where the overload takes them."""
    out: list[Case] = []
    for name, packet in _packets():
        kinds = _operands(packet)
        if kinds is None:
            continue
        fn = _public(name, packet)
        out.append((name, fn, kinds))
        if kinds.count("x") > 1:
            first = kinds.index("x")
            out.append((f"{name} (per-channel operands)", fn,
                        ["chan" if k == "x" and i != first else k for i, k in enumerate(kinds)]))
            out.append((f"{name} (per-channel first)", fn,
                        ["chan" if k == "x" and i == first else k for i, k in enumerate(kinds)]))
    return out


def _integer(name: str) -> bool:
    return any(s in name for s in ("bitwise", "gcd", "lcm", "shift", "__and__", "__or__", "__xor__", "__i"))


def _args(kinds: list[str], x: torch.Tensor, y: torch.Tensor, chan: torch.Tensor, mask: torch.Tensor) -> list:
    blocks = iter([x, y, y])
    return [next(blocks) if k == "x" else chan if k == "chan" else mask if k == "mask" else 2 if k == "int"
            else -0.5 for k in kinds]


def _inputs(name: str, shape: tuple[int, ...], g: torch.Generator) -> tuple[torch.Tensor, ...]:
    if _integer(name):
        return (torch.randint(1, 7, shape, generator=g), torch.randint(1, 4, shape, generator=g),
                torch.randint(1, 4, (shape[1], 1, 1), generator=g))
    return (torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64),
            torch.randn((shape[1], 1, 1), generator=g, dtype=torch.float64))


def test_tagged_pointwise_calls_are_pointwise_and_reductions_sharing_their_packets_are_not():
    x, c = torch.randn(2, 3, 4, 4, dtype=torch.float64), torch.randn(3, 1, 1, dtype=torch.float64)
    missed = []
    for label, fn, kinds in cases():
        args = _args(kinds, x, x.clone(), c, x > 0)
        if not is_pointwise(fn, getattr(fn, "__name__", label), tuple(args), {}):
            missed.append(label)
    assert len(cases()) > 300 and not missed, f"{len(cases())} cases, not pointwise: {missed}"
    for fn, args in [(torch.max, (x, 1)), (torch.Tensor.max, (x,)), (torch.where, (x > 0,)), (torch.sum, (x,)),
                     (torch.cumsum, (x, 1)), (torch.softmax, (x, 1)), (torch.flip, (x, [2])),
                     (torch.roll, (x, 1, 2)), (F.dropout2d, (x,)), (torch.Tensor.__matmul__, (x, x)),
                     (torch.equal, (x, x))]:
        assert not is_pointwise(fn, fn.__name__, args, {}), fn.__name__
    for fn, args in [(torch.max, (x, c)), (torch.where, (x > 0, x, 0.0)), (F.softsign, (x,)),
                     (torch.special.expit, (x,)), (F.tanhshrink, (x,)), (torch.Tensor.__rsub__, (x, 1.0))]:
        assert is_pointwise(fn, fn.__name__, args, {}), fn.__name__


@pytest.mark.mpi
def test_every_tagged_pointwise_op_runs_on_the_block_without_moving_it_and_equals_one_process(comm):
    """Every case runs on blocks of a (size, 1) grid (at 4 ranks also 2 sample groups of a 2 x 1 grid);
    the results (cast to float64 and concatenated along channels: still blocks) are gathered once and
    equal one process's within 1e-12 relative (NaN where it has NaN; torch's vectorised and scalar
    loops round transcendentals differently at the last bit, by where a cell falls in the block), and
    nothing is redistributed."""
    grids = [((comm.size, 1), 1)] + ([((2, 1), 2)] if comm.size == 4 else [])
    shape = (2, 3, 2 * comm.size + 1, 3)
    for grid, samples in grids:
        dist = Distribution(comm, grid, samples)
        got, expected, labels = [], [], []
        g = torch.Generator().manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecation and domain warnings of some ops; not ours
            for label, fn, kinds in cases():
                x, y, c = _inputs(label, shape, g)
                mask = x > x.flatten().median() if x.is_floating_point() else x > 3
                try:
                    want = fn(*_args(kinds, x.clone(), y.clone(), c, mask))
                except (RuntimeError, TypeError):
                    continue  # a dtype/operand combination torch itself refuses
                blocks = _args(kinds, dist.scatter(x.clone()), dist.scatter(y.clone()), c, dist.scatter(mask))
                have = fn(*blocks)
                pairs = zip(have, want) if isinstance(want, tuple) else [(have, want)]  # frexp: two outputs
                for h, w in pairs:
                    got.append(h.double())
                    expected.append(w.double())
                    labels.append(label)
        whole = gather(torch.cat(got, dim=1))
        ref = torch.cat(expected, dim=1)
        bad = [labels[i] for i, (a, b) in enumerate(zip(whole.split(3, 1), ref.split(3, 1)))
               if not torch.allclose(a, b, rtol=1e-12, atol=1e-300, equal_nan=True)]
        assert_all_ranks(comm, len(labels) > 300 and not bad and dist.redistributions == {},
                         f"grid {grid}x{samples}: {len(labels)} cases; differ from one process: {bad}; "
                         f"redistributed: {dist.redistributions}")
