"""`Layout`: where every partition of a pipeline runs, known at construction (no model, no sample).

A pipeline of P pipeline ranks times R replicas on ``P * R`` ranks (:class:`~mpitrain.comm.place.Place`:
world rank ``r * P + p`` runs pipeline rank p of replica r) cuts its model into ``P * V`` partitions,
V per pipeline rank (:func:`.schedule.chunks_per_rank`: virtual stages of interleaved-1f1b, zbv's 2).
Which rank runs which partition is the schedule's placement (:func:`.schedule.placement`): "loop"
(rank p runs p, p + P, ...) or zbv's "v" (p and 2P-1-p). A `Layout` is a pure, frozen value (the
torchtitan ``ParallelDims`` of a pipeline); :meth:`Layout.split` is its one collective, creating the
sub-communicators.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ...comm.base import Communicator
from ...comm.place import Place
from .schedule import SCHEDULES, chunks_per_rank, placement

__all__ = ["Layout", "Groups"]


class Groups(NamedTuple):
    """A pipeline rank's sub-communicators: `pipe` (its replica's P ranks, in pipeline-rank order:
    activations and partial errors) and `group` (the R ranks holding its pipeline rank, in replica
    order: the gradient average, ZeRO's shards)."""

    pipe: Communicator
    group: Communicator


@dataclass(frozen=True)
class Layout:
    """This rank's `place` (replicas x partitions), the `schedule` and `V` partitions per pipeline rank.

    Everything derived is pure and the same on every rank: :attr:`where` (the partitions of every
    pipeline rank, in chunk order), :meth:`rank_of`, :attr:`last_rank`, :attr:`mine`. Raises ValueError
    for an unknown schedule or a V the schedule cannot run (callers check options first, as FitError)."""

    place: Place
    schedule: str
    V: int = 1
    #: ``where[p][c]``: the partition that pipeline rank p runs as its chunk c
    where: tuple[tuple[int, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {sorted(SCHEDULES)}")
        if self.V != chunks_per_rank(self.schedule, self.V):
            raise ValueError(f"schedule {self.schedule!r} runs {chunks_per_rank(self.schedule, self.V)} "
                             f"partitions per rank, not V={self.V}")
        rows = placement(self.schedule, self.P, self.V)
        object.__setattr__(self, "where", tuple(tuple(row) for row in rows))

    @classmethod
    def of(cls, world: int, rank: int, partitions: int | None, replicas: int | None, schedule: str,
           virtual_stages: int = 2) -> Layout:
        """The layout of world rank `rank` (a degree left as None filled in from `world`; PlaceError if
        they do not fill it); `virtual_stages` counts only for interleaved-1f1b."""
        place = Place.of(world, rank, replicas=replicas, partitions=partitions)
        return cls(place, schedule, chunks_per_rank(schedule, virtual_stages))

    @property
    def P(self) -> int:
        """Pipeline ranks per replica."""
        return self.place.partitions

    @property
    def R(self) -> int:
        """Replicas."""
        return self.place.replicas

    @property
    def p(self) -> int:
        """This rank's pipeline rank."""
        return self.place.partition

    @property
    def replica(self) -> int:
        return self.place.replica

    @property
    def parts(self) -> int:
        """Partitions of the model: ``P * V``."""
        return self.P * self.V

    @property
    def placement_name(self) -> str:
        """"v" for zbv's V placement, "loop" for every other schedule (a checkpoint's layout records it)."""
        return "v" if self.schedule == "zbv" else "loop"

    def rank_of(self, k: int) -> int:
        """The pipeline rank running partition `k`."""
        return next(p for p, row in enumerate(self.where) if k in row)

    @property
    def ranks(self) -> list[int]:
        """The pipeline rank of every partition, in partition order."""
        return [self.rank_of(k) for k in range(self.parts)]

    @property
    def last_rank(self) -> int:
        """The pipeline rank running the model's last partition (it computes the loss)."""
        return self.rank_of(self.parts - 1)

    @property
    def mine(self) -> tuple[int, ...]:
        """This rank's partitions, in chunk order (ascending partition index)."""
        return self.where[self.p]

    def world_rank(self, replica: int, p: int) -> int:
        """The world rank running pipeline rank `p` of `replica`."""
        return self.place.rank_of(replica, p)

    def split(self, comm: Communicator) -> Groups:
        """Collective over `comm` (the world of :attr:`place`, every rank): the sub-communicators."""
        groups = self.place.split(comm, ("replica", "partition"))
        return Groups(groups.of("partition"), groups.of("replica"))
