"""`Place`: the pure mapping of world ranks to (replica, partition, grid cell), checked exhaustively over
every layout of worlds of 1 to 8 ranks; the sub-communicators it splits, over real MPI."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mpitrain.comm.place import AXES, Coords, Place, PlaceError
from tests.helpers import assert_all_ranks


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _grids(n: int) -> list[tuple[int, ...]]:
    """Every 1-, 2- and 3-D grid of exactly `n` cells."""
    return [g for k in (1, 2, 3) for g in itertools.product(_divisors(n), repeat=k) if math.prod(g) == n]


def _layouts(world: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """Every (replicas, partitions, grid) whose product is `world`."""
    return [(r, p, g) for r in _divisors(world) for p in _divisors(world // r) for g in _grids(world // (r * p))]


WORLDS = range(1, 9)


@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_gets_distinct_coordinates_that_map_back_to_it(world):
    for replicas, partitions, grid in _layouts(world):
        places = [Place(world, r, replicas, partitions, grid) for r in range(world)]
        coords = [p.coords for p in places]
        assert len(set(coords)) == world
        for r, (p, c) in enumerate(zip(places, coords)):
            assert 0 <= c.replica < replicas and 0 <= c.partition < partitions
            assert all(0 <= x < g for x, g in zip(c.cell, grid)) and len(c.cell) == len(grid)
            assert p.rank_of(*c) == r and p.coords_of(r) == c
            assert p.index_of(c.cell) == p.cell_index == r % math.prod(grid)


@pytest.mark.parametrize("world", WORLDS)
def test_the_rule_is_replica_outermost_then_partition_then_row_major_cell(world):
    for replicas, partitions, grid in _layouts(world):
        place = Place(world, 0, replicas, partitions, grid)
        order = [Coords(r, p, c) for r in range(replicas) for p in range(partitions)
                 for c in itertools.product(*(range(g) for g in grid))]
        assert [place.coords_of(r) for r in range(world)] == order


@pytest.mark.parametrize("world", WORLDS)
def test_each_axis_partitions_the_world_into_groups_that_vary_only_along_it(world):
    for replicas, partitions, grid in _layouts(world):
        place = Place(world, 0, replicas, partitions, grid)
        sizes = {"replica": replicas, "partition": partitions, "spatial": math.prod(grid)}
        for axis in AXES:
            groups = {place.members(axis, r) for r in range(world)}
            assert sorted(r for g in groups for r in g) == list(range(world))  # disjoint, covering
            assert place.all_members(axis) == sorted(groups)
            for g in groups:
                assert len(g) == sizes[axis] and list(g) == sorted(g)
                assert [place.coordinate(axis, r) for r in g] == list(range(sizes[axis]))
                fixed = [a for a in AXES if a != axis]
                assert len({tuple(place.coordinate(a, r) for a in fixed) for r in g}) == 1


def test_the_pipeline_and_spatial_rules_are_special_cases():
    """World rank r * P + p runs partition p of replica r; r * cells + s is cell s of sample group r."""
    for world in WORLDS:
        for p in _divisors(world):
            place = Place.of(world, 0, partitions=p)
            assert all(place.coords_of(r)[:2] == divmod(r, p) for r in range(world))
        for g in _grids(world):
            place = Place.of(world, 0, grid=g)
            assert place.replicas == 1 and [place.coords_of(r).cell for r in range(world)] == \
                list(itertools.product(*(range(x) for x in g)))


def test_of_infers_partitions_first_then_replicas():
    assert (Place.of(8, 0, partitions=None).partitions, Place.of(8, 0, partitions=None).replicas) == (8, 1)
    assert Place.of(8, 0, replicas=2, partitions=None).partitions == 4
    assert Place.of(8, 0, partitions=2).replicas == 4
    assert Place.of(8, 0, grid=(2, 2)).replicas == 2
    assert Place.of(6, 5, replicas=3, partitions=None, grid=[2]).grid == (2,)


@pytest.mark.parametrize("kwargs, match", [
    ({"partitions": 3}, "3 partitions .* do not divide the 4 ranks"),
    ({"replicas": 3, "partitions": None}, "3 replicas .* do not divide the 4 ranks"),
    ({"grid": (3, 1)}, "grid 3x1 .* do not divide the 4 ranks"),
    ({"replicas": 2, "partitions": 2, "grid": (2,)}, "2 replicas x 2 partitions x grid 2 \\(= 8 ranks\\) do not "
                                                     "divide the 4 ranks"),
    ({"partitions": 0}, "partitions must be a positive int"),
    ({"replicas": True}, "replicas must be a positive int"),
    ({"grid": (2, 0)}, "every grid dimension must be a positive int"),
    ({"grid": ()}, "at least one dimension"),
])
def test_a_layout_that_does_not_place_the_world_is_refused_naming_both(kwargs, match):
    with pytest.raises(PlaceError, match=match):
        Place.of(4, 0, **kwargs)


def test_the_constructor_checks_the_product_and_the_rank():
    with pytest.raises(PlaceError, match="replicas x partitions x grid = 1 x 2 x \\(1\\) = 2 ranks, but the world "
                                         "has 4 ranks"):
        Place(4, 0, 1, 2)
    with pytest.raises(PlaceError, match="rank must be an int in \\[0, 4\\)"):
        Place(4, 4, 4)
    with pytest.raises(PlaceError, match="outside"):
        Place(4, 0, 4).coords_of(7)


def test_a_place_is_a_frozen_printable_value():
    place = Place.of(8, 5, replicas=2, grid=(2, 2))
    assert place == Place(8, 5, 2, 1, (2, 2)) and hash(place) == hash(Place(8, 5, 2, 1, (2, 2)))
    assert str(place) == "Place(rank 5 of 8: replica 1 of 2, partition 0 of 1, cell (0, 1) of grid 2x2)"
    with pytest.raises(AttributeError):
        place.rank = 0  # type: ignore[misc]


# -- over MPI -------------------------------------------------------------------------------------------


@pytest.mark.mpi
def test_each_sub_communicator_holds_the_ranks_the_place_names_in_its_order(comm):
    """For every layout of the world: split all three axes, allgather the world ranks over each group and
    compare with ``Place.members`` (which also fixes each rank's rank in the group)."""
    for replicas, partitions, grid in _layouts(comm.size):
        place = Place(comm.size, comm.rank, replicas, partitions, grid)
        groups = place.split(comm)
        for axis in AXES:
            sub = groups.of(axis)
            got = sub.allgather(torch.tensor([comm.rank], dtype=torch.int64)).tolist()
            ok = got == list(place.members(axis)) and sub.rank == place.coordinate(axis)
            assert_all_ranks(comm, ok, f"{place}: {axis} group {got}, expected {place.members(axis)}")
            sub.free()


@pytest.mark.mpi
def test_split_makes_only_the_axes_asked_for_and_refuses_another_world(comm):
    place = Place.of(comm.size, comm.rank, partitions=None)
    groups = place.split(comm, ("partition",))
    ok = groups.replica is None and groups.spatial is None and groups.of("partition").size == comm.size
    with pytest.raises(PlaceError, match="not split"):
        groups.of("replica")
    with pytest.raises(PlaceError, match="was made for rank"):  # local: no message is sent
        Place.of(comm.size + 1, comm.rank, partitions=None).split(comm)
    groups.of("partition").free()
    assert_all_ranks(comm, ok, "only the partition group was split")
