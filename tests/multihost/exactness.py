"""The hierarchical allreduce against a flat one (raw mpi4py on the same data), shared by the emulated-host
job and the one-machine MPI test: sizes below, between and above the thresholds, exact data (integers,
integer-valued floats; the largest goes through the shared-memory host stages), blocking and
nonblocking, several in flight at once, a blocking one behind nonblocking ones in flight."""

from __future__ import annotations

import torch
from mpi4py import MPI

from mpitrain.comm._hierarchical import HIERARCHY_ABOVE, RING_ABOVE, SHARED_STAGES_ABOVE
from mpitrain.comm._mpi import MPICommunicator

__all__ = ["compare_with_flat"]

_CASES = [(torch.float64, "sum", True), (torch.float64, "avg", False), (torch.int64, "sum", False),
          (torch.int64, "max", True), (torch.float32, "sum", False)]


def _check(comm: MPICommunicator, numel: int, dtype: torch.dtype, op: str, nonblocking: bool) -> str | None:
    g = torch.Generator().manual_seed(1234 + comm.rank)
    t = torch.randint(-1000, 1000, (numel,), generator=g).to(dtype)
    ref = t.clone()
    comm.mpi_comm.Allreduce(MPI.IN_PLACE, ref.numpy(), op=MPI.MAX if op == "max" else MPI.SUM)
    if op == "avg":
        ref.div_(comm.size)
    out = comm.iallreduce(t, op).wait() if nonblocking else comm.allreduce(t, op)
    if out is None or not torch.equal(out, ref):
        return f"{numel} x {dtype} {op} nonblocking={nonblocking}"
    return None


def compare_with_flat(comm: MPICommunicator) -> list[str]:
    """Failures (empty: every case equal bitwise). Collective over `comm`."""
    failures = []
    for nbytes in (4 << 10, HIERARCHY_ABOVE + 8, 2 * RING_ABOVE + 24, SHARED_STAGES_ABOVE + 24):
        for dtype, op, nonblocking in _CASES:
            for nb in {False, nonblocking}:
                bad = _check(comm, nbytes // torch.empty(0, dtype=dtype).element_size(), dtype, op, nb)
                if bad:
                    failures.append(bad)
    # several nonblocking allreduces in flight at once, waited in reverse order
    reqs = []
    for i in range(3):
        t = torch.full((RING_ABOVE // 8 + i,), float(comm.rank + i), dtype=torch.float64)
        reqs.append((comm.iallreduce(t), t, float(sum(r + i for r in range(comm.size)))))
    # a blocking allreduce while those are in flight (queued behind them), then one with none in flight
    # (run on the calling thread)
    for when in ("behind nonblocking ones", "alone"):
        t = torch.full((SHARED_STAGES_ABOVE // 4 + 3,), float(comm.rank), dtype=torch.float32)
        comm.allreduce(t)
        if not bool((t == float(sum(range(comm.size)))).all()):
            failures.append(f"blocking allreduce {when}")
        for req, t, want in reversed(reqs):
            req.wait()
            if not bool((t == want).all()):
                failures.append(f"overlapping iallreduce of {t.numel()} elements")
        reqs = []
    return failures
