"""Process sets: subsets of ranks that run collectives together (Horovod's ``process_sets``).

Each set owns a private communicator of the engine (split from the global one when the set is added),
so its traffic never mixes with other sets' or with the caller's own mpitrain collectives."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._basics import ON_INIT, ON_SHUTDOWN, rank, size, state
from ._engine import Key, Op
from ._handles import submit, synchronize

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


class ProcessSet:
    """A set of global ranks. Build it from a list of ranks, then pass it to ``init(process_sets=...)``
    or :func:`add_process_set`; once added, ``process_set_id`` is set.

    ``rank()`` is this process's rank *within* the set; collectives still take *global* root ranks.
    Building one from an mpi4py communicator is refused (use the list of its ranks)."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Iterable[int]) -> None:
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet takes a list of process ranks (building one from an MPI "
                             "communicator is not supported by mpitrain.horovod)") from None
        if any(not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet takes a list of integer ranks, got {ranks}")
        self.ranks = ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> int | None:
        """Number of ranks in the set, or None if the set is not (or no longer) added."""
        return None if self.process_set_id is None or self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set; None if the set is not added; -1 if not included."""
        if self.process_set_id is None or self.ranks is None:
            return None
        me = rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool | None:
        """Whether this process is in the set (None before the ranks are known)."""
        return None if self.ranks is None else rank() in self.ranks

    def _root(self, root_rank: int) -> int:
        """The set rank of global rank `root_rank` (ValueError if it is not in the set)."""
        assert self.ranks is not None
        if root_rank not in self.ranks:
            raise ValueError(f"root_rank {root_rank} is not in {self}; root_rank is a global rank")
        return self.ranks.index(root_rank)

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_sets: dict[int, ProcessSet] = {}
_next_id = 1


def _run(op: Op) -> Any:
    return synchronize(submit(op))


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Collective over *every* rank of the job: add a set and return it (initialized).

    Every rank must pass the same ranks (else HorovodInternalError on every rank); a set with the same
    ranks as an existing one (the global set included) raises ValueError on every rank."""
    global _next_id
    st = state()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    assert ps.ranks is not None
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} was already added")
    bad = [r for r in ps.ranks if not 0 <= r < size()]
    if not ps.ranks or bad or len(set(ps.ranks)) != len(ps.ranks):
        raise ValueError(f"process set ranks must be distinct ranks in [0, {size()}), got {ps.ranks}")
    new_id = _next_id
    ranks = list(ps.ranks)
    me = st.world.rank

    def execute(comm: Any, infos: list[Any]) -> bool:
        if any(s.ranks == ranks for s in _sets.values()):
            return False  # every rank sees the same registry, so every rank refuses together
        st.engine.comms[new_id] = comm.split(1 if me in ranks else None, me)
        return True

    key: Key = ("add_process_set", None, (("ranks", tuple(ranks)), ("id", new_id)))
    _next_id += 1
    if not _run(Op("add_process_set", None, 0, key, None, execute)):
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    ps.process_set_id = new_id
    _sets[new_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Collective over every rank: remove an added set and invalidate the object. Returns False (and
    does nothing) for the global set or a set that is not added."""
    state()
    pid = process_set.process_set_id
    if pid is None or pid == 0 or pid not in _sets:
        return False
    st = state()

    def execute(comm: Any, infos: list[Any]) -> None:
        sub = st.engine.comms.pop(pid, None)
        if sub is not None:
            sub.free()

    _run(Op("remove_process_set", None, 0, ("remove_process_set", None, (("id", pid),)), None, execute))
    del _sets[pid]
    process_set._invalidate()
    return True


def _on_init(process_sets: Any) -> None:
    global _next_id
    global_process_set.ranks = list(range(size()))
    global_process_set.process_set_id = 0
    _sets.clear()
    _sets[0] = global_process_set
    _next_id = 1
    if isinstance(process_sets, (list, tuple)):
        for ps in process_sets:
            add_process_set(ps)


def _on_shutdown() -> None:
    for pid, ps in list(_sets.items()):
        if pid != 0:
            ps._invalidate()
    _sets.clear()


ON_INIT.append(_on_init)
ON_SHUTDOWN.append(_on_shutdown)


def _resolve(process_set: ProcessSet) -> tuple[int, list[int]]:
    """(id, ranks) of an added set this rank belongs to; ValueError otherwise (before any message)."""
    pid = process_set.process_set_id
    if pid is None or pid not in _sets or process_set.ranks is None:
        raise ValueError(f"{process_set} has not been added (hvd.add_process_set) or was removed")
    if rank() not in process_set.ranks:
        raise ValueError(f"rank {rank()} is not in {process_set}; only its ranks may call collectives on it")
    return pid, process_set.ranks
