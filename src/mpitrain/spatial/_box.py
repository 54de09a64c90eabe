"""Box and HaloPlan: the pure data of a halo plan (global index boxes, what a rank owns, needs and
exchanges). Below both the geometry that builds plans (:mod:`.halo`) and the exchange that follows them
(:mod:`._exchange`), so neither imports the other's module to name them; :mod:`.halo` exports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Box", "HaloPlan"]


class Box:
    """A half-open box of global indices, one ``(start, stop)`` per spatial dimension: ``Box(rows, cols)``
    for images, ``Box(depths, rows, cols)`` for volumes."""

    __slots__ = ("dims",)

    def __init__(self, *dims: tuple[int, int]) -> None:
        self.dims: tuple[tuple[int, int], ...] = tuple((int(a), int(b)) for a, b in dims)

    @property
    def rows(self) -> tuple[int, int]:
        return self.dims[-2]

    @property
    def cols(self) -> tuple[int, int]:
        return self.dims[-1]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Box) and self.dims == other.dims

    def __hash__(self) -> int:
        return hash(self.dims)

    def __repr__(self) -> str:
        return f"Box{self.dims}"

    @property
    def empty(self) -> bool:
        return any(b <= a for a, b in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(max(0, b - a) for a, b in self.dims)

    def __and__(self, other: Box) -> Box:
        return Box(*((max(a, c), min(b, d)) for (a, b), (c, d) in zip(self.dims, other.dims)))

    def within(self, origin: Box) -> tuple[Any, ...]:
        """Index (one slice per dimension) of this box inside a tensor whose corner is ``origin``'s."""
        return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(self.dims, origin.dims))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{a}:{b}" for a, b in self.dims) + "]"


@dataclass(frozen=True)
class HaloPlan:
    """What one rank of the spatial group owns, needs and exchanges for one layer (global indices).

    ``need`` is the (unclipped) input rectangle its output block ``out`` reads; ``local`` the part it
    owns; ``recvs``/``sends`` list ``(spatial rank, box)`` in rank order. Parts of ``need`` outside
    ``valid`` (the global tensor) are padding."""

    rank: int
    owned: Box
    out: Box
    need: Box
    valid: Box
    local: Box
    recvs: tuple[tuple[int, Box], ...]
    sends: tuple[tuple[int, Box], ...]

    @property
    def ext_shape(self) -> tuple[int, ...]:
        return self.need.shape

    @property
    def exchanges(self) -> bool:
        return bool(self.recvs or self.sends)

    def __str__(self) -> str:
        recv = ", ".join(f"{b}<-{r}" for r, b in self.recvs) or "-"
        send = ", ".join(f"{b}->{r}" for r, b in self.sends) or "-"
        return (f"rank {self.rank}: owns {self.owned} out {self.out} needs {self.need} "
                f"local {self.local} recv {recv} send {send}")
