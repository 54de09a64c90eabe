"""`Place`: where a rank sits in a job laid out as replicas x pipeline partitions x a spatial grid.

The one placement rule of the project (pipeline, hybrid, spatial and its sample x spatial hybrids, data
parallel and pipe-sgd as the case of every rank a replica)::

    world rank = (replica * partitions + partition) * cells + cell      cells = prod(grid)

where `cell` is the row-major index of the rank's grid position. A replica's ranks are consecutive, so
one pipeline (or one spatial group) fills a node and replicas span nodes (HyPar-Flow §6.5); inside a
replica, one partition's grid is consecutive.

A `Place` is a pure, frozen, printable value: building it sends nothing, and a layout that does not
divide the world is refused (:class:`PlaceError`, naming both) on every rank alike, before any message.
:meth:`Place.split` then creates the sub-communicators, collectively, always in the order of
:data:`AXES` (replica, partition, spatial) whichever subset a caller asks for; each group's ranks are
ordered by their coordinate along its axis, which is also their world-rank order:

- ``replica``: the ranks holding the same partition and grid cell in every replica (gradient averages;
  ZeRO's shard group, which for a whole model on every rank is the world);
- ``partition``: the ranks of one replica at the same grid cell, one per partition (a pipeline's
  activations and partial errors);
- ``spatial``: the grid of one replica and partition (halo exchanges, spatial reductions).

Private duplicates that a component splits to keep its collectives apart from its caller's (ZeRO's,
pipe-sgd's, the kvstores') and groups that depend on a model (a pipeline's tied parameters) or on hosts
are not places, and are split where they are used.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple

from .base import Communicator

__all__ = ["AXES", "Axis", "Coords", "Groups", "Place", "PlaceError"]

Axis = Literal["replica", "partition", "spatial"]

#: The axes, outermost first; sub-communicators are always split in this order.
AXES: tuple[Axis, ...] = ("replica", "partition", "spatial")


class PlaceError(ValueError):
    """A layout that cannot place the ranks (degrees that are not positive ints, a product that is not
    the world size, a rank outside the world); raised locally, before any message."""


class Coords(NamedTuple):
    """A rank's coordinates: its replica, its partition and its grid cell (row-major, outermost first)."""

    replica: int
    partition: int
    cell: tuple[int, ...]


def _positive(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PlaceError(f"{name} must be a positive int, got {v!r}")
    return v


def _grid(grid: Iterable[int]) -> tuple[int, ...]:
    try:
        out = tuple(grid)
    except TypeError:
        raise PlaceError(f"grid must be a tuple of positive ints, got {grid!r}") from None
    if not out:
        raise PlaceError("grid must have at least one dimension (use (1,) for none)")
    for g in out:
        _positive("every grid dimension", g)
    return out


@dataclass(frozen=True)
class Place:
    """World rank `rank` of `world` ranks laid out as `replicas` x `partitions` x `grid` (module doc).

    Construct with :meth:`of` to have one degree inferred from the world size; the constructor checks
    every field (:class:`PlaceError`). Coordinates, group members and the inverse mapping are pure."""

    world: int
    rank: int
    replicas: int
    partitions: int = 1
    grid: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        _positive("the world size", self.world)
        for name in ("replicas", "partitions"):
            _positive(name, getattr(self, name))
        object.__setattr__(self, "grid", _grid(self.grid))  # a list is accepted, a tuple is kept
        if self.replicas * self.partitions * self.cells != self.world:
            raise PlaceError(f"{self.describe()} = {self.replicas * self.partitions * self.cells} ranks, but the "
                             f"world has {self.world} ranks")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise PlaceError(f"rank must be an int in [0, {self.world}), got {self.rank!r}")

    @classmethod
    def of(cls, world: int, rank: int, *, replicas: int | None = None, partitions: int | None = 1,
           grid: Iterable[int] = (1,)) -> Place:
        """The place of `rank`, a degree left as None filled in from `world`: `partitions` first (all
        the ranks a replica count and grid leave), then `replicas`. A world that the given degrees do
        not divide is a PlaceError naming both."""
        g = _grid(grid)
        given = [(n, _positive(n, v)) for n, v in (("replicas", replicas), ("partitions", partitions)) if v is not None]
        per = math.prod(g) * math.prod(v for _, v in given)
        if world % per:
            what = " x ".join([f"{v} {n}" for n, v in given] + ([f"grid {_show(g)}"] if math.prod(g) > 1 else []))
            raise PlaceError(f"{what} (= {per} ranks) do not divide the {world} ranks of the world")
        if partitions is None:
            partitions = world // per
            per *= partitions
        if replicas is None:
            replicas = world // per
        return cls(world, rank, replicas, partitions, g)

    # -- the mapping -------------------------------------------------------------------------------
    @property
    def cells(self) -> int:
        """Ranks per grid (``prod(grid)``)."""
        return math.prod(self.grid)

    def coords_of(self, rank: int) -> Coords:
        """The coordinates of world rank `rank`."""
        if not 0 <= rank < self.world:
            raise PlaceError(f"rank {rank} is outside the world of {self.world} ranks")
        rest, index = divmod(rank, self.cells)
        replica, partition = divmod(rest, self.partitions)
        return Coords(replica, partition, self.cell_of(index))

    def rank_of(self, replica: int, partition: int = 0, cell: tuple[int, ...] | None = None) -> int:
        """The world rank at these coordinates (`cell` None: the grid's origin); the inverse of
        :meth:`coords_of`."""
        index = 0 if cell is None else self.index_of(cell)
        if not (0 <= replica < self.replicas and 0 <= partition < self.partitions):
            raise PlaceError(f"replica {replica}, partition {partition} outside {self.describe()}")
        return (replica * self.partitions + partition) * self.cells + index

    def cell_of(self, index: int) -> tuple[int, ...]:
        """The row-major grid position of cell `index` (a spatial rank)."""
        out = []
        for g in reversed(self.grid):
            index, c = divmod(index, g)
            out.append(c)
        return tuple(reversed(out))

    def index_of(self, cell: tuple[int, ...]) -> int:
        """The row-major index (spatial rank) of grid position `cell`."""
        if len(cell) != len(self.grid) or any(not 0 <= c < g for c, g in zip(cell, self.grid)):
            raise PlaceError(f"cell {cell!r} is outside grid {_show(self.grid)}")
        index = 0
        for c, g in zip(cell, self.grid):
            index = index * g + c
        return index

    @property
    def coords(self) -> Coords:
        return self.coords_of(self.rank)

    @property
    def replica(self) -> int:
        return self.coords.replica

    @property
    def partition(self) -> int:
        return self.coords.partition

    @property
    def cell(self) -> tuple[int, ...]:
        return self.coords.cell

    @property
    def cell_index(self) -> int:
        """This rank's row-major index in its grid (its rank in the spatial group)."""
        return self.rank % self.cells

    # -- the groups --------------------------------------------------------------------------------
    def coordinate(self, axis: Axis, rank: int | None = None) -> int:
        """`rank`'s (default: this rank's) coordinate along `axis`: its rank in that group."""
        c = self.coords_of(self.rank if rank is None else rank)
        return {"replica": c.replica, "partition": c.partition, "spatial": self.index_of(c.cell)}[_axis(axis)]

    def members(self, axis: Axis, rank: int | None = None) -> tuple[int, ...]:
        """The world ranks of `rank`'s (default: this rank's) group along `axis`, in group-rank order."""
        c = self.coords_of(self.rank if rank is None else rank)
        axis = _axis(axis)
        if axis == "replica":
            return tuple(self.rank_of(r, c.partition, c.cell) for r in range(self.replicas))
        if axis == "partition":
            return tuple(self.rank_of(c.replica, p, c.cell) for p in range(self.partitions))
        base = self.rank_of(c.replica, c.partition)
        return tuple(range(base, base + self.cells))

    def all_members(self, axis: Axis) -> list[tuple[int, ...]]:
        """Every group along `axis` (:meth:`members`), by lowest world rank: a partition of the world."""
        return sorted({self.members(axis, r) for r in range(self.world)})

    def split(self, comm: Communicator, axes: Iterable[Axis] = AXES) -> Groups:
        """The sub-communicators of `axes` (collective over `comm`, the world this place was made for:
        every rank must pass the same `axes`). They are split in the order of :data:`AXES`, one
        ``comm.split`` each, the colour being the group's lowest world rank and the key the rank's
        coordinate along the axis. A `comm` that is not this place's world is refused before any message."""
        if comm.size != self.world or comm.rank != self.rank:
            raise PlaceError(f"{self} was made for rank {self.rank} of {self.world}; the communicator is rank "
                             f"{comm.rank} of {comm.size}")
        wanted = {_axis(a) for a in axes}
        made: dict[str, Communicator] = {}
        for axis in AXES:
            if axis in wanted:
                sub = comm.split(self.members(axis)[0], self.coordinate(axis))
                assert sub is not None  # every rank passes a colour
                made[axis] = sub
        return Groups(self, made.get("replica"), made.get("partition"), made.get("spatial"))

    # -- printing ----------------------------------------------------------------------------------
    def describe(self) -> str:
        """The layout without the rank: ``replicas x partitions x grid = 2 x 2 x (1x1)``."""
        return f"replicas x partitions x grid = {self.replicas} x {self.partitions} x ({_show(self.grid)})"

    def __str__(self) -> str:
        c = self.coords
        return (f"Place(rank {self.rank} of {self.world}: replica {c.replica} of {self.replicas}, partition "
                f"{c.partition} of {self.partitions}, cell {c.cell} of grid {_show(self.grid)})")


@dataclass(frozen=True)
class Groups:
    """The sub-communicators :meth:`Place.split` made (None: an axis not asked for)."""

    place: Place
    replica: Communicator | None
    partition: Communicator | None
    spatial: Communicator | None

    def of(self, axis: Axis) -> Communicator:
        """The group along `axis`; a PlaceError if it was not split."""
        sub: Communicator | None = getattr(self, _axis(axis))
        if sub is None:
            raise PlaceError(f"the {axis} group was not split (Place.split(comm, axes) names the ones made)")
        return sub


def _axis(axis: str) -> Axis:
    if axis not in AXES:
        raise PlaceError(f"axis must be one of {AXES}, got {axis!r}")
    return axis


def _show(grid: tuple[int, ...]) -> str:
    return "x".join(map(str, grid))
