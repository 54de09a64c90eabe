"""Handles of queued Horovod operations: ``submit`` (an :class:`~._engine.Op` -> an int handle),
``synchronize`` and ``poll``; below the collectives and process sets that submit, above the state they read.
Handles of an engine are void after ``shutdown()``, as Horovod's."""

from __future__ import annotations

import itertools
from typing import Any

from .._utils.stall import StallPolicy, wait_until
from ._basics import ON_SHUTDOWN, HorovodInternalError, state
from ._engine import Op

__all__ = ["submit", "synchronize", "poll", "WAIT_POLICY"]

#: How long synchronize() waits before a warning, and before it ends the job (a peer never came).
WAIT_POLICY = StallPolicy(warn_after=60.0, abort_after=600.0, max_nap=2.5e-4)

_handle_map: dict[int, Op] = {}
_handles = itertools.count(1)
ON_SHUTDOWN.append(_handle_map.clear)  # handles of the old engine are void, as Horovod's after shutdown


def submit(op: Op) -> int:
    """Queue `op` on the engine and return its handle (ValueError while an op of the same name is in flight)."""
    # "in flight" lasts until synchronize(), not until completion, so the rule does not depend on timing
    if op.name is not None and any(o.name == op.name and o.pset_id == op.pset_id for o in _handle_map.values()):
        raise ValueError(f"{op.kind}: an operation named {op.name!r} is already in flight on this rank (not yet "
                         f"synchronized); names of concurrent operations must be unique")
    state().engine.submit(op)
    handle = next(_handles)
    _handle_map[handle] = op
    return handle


def synchronize(handle: int) -> Any:
    """Wait until the operation of `handle` completed on this rank and return its result (a tensor, a
    list of tensors for grouped ops, ``(output, received_splits)`` for alltoall). Re-raises its error:
    ValueError for bad arguments found during negotiation, HorovodInternalError for cross-rank
    mismatches and failures. An unknown (or already synchronized) handle returns None, as Horovod."""
    op = _handle_map.pop(handle, None)
    if op is None:
        return None
    if not op.done.is_set():
        st = state()
        wait_until(op.done.is_set, lambda: f"{op.describe()} to complete on every rank of its process set",
                   WAIT_POLICY, who=f"rank {st.world.rank}", abort=st.world.abort)
    if op.error is not None:
        if isinstance(op.error, (HorovodInternalError, ValueError, NotImplementedError)):
            raise op.error
        raise HorovodInternalError(f"{op.describe()} failed: {op.error}") from op.error
    return op.result


def poll(handle: int) -> bool:
    """True once the operation of `handle` has completed (then synchronize() returns at once). Never blocks."""
    op = _handle_map.get(handle)
    if op is None:
        raise ValueError(f"unknown or already synchronized handle {handle!r}")
    return op.done.is_set()
