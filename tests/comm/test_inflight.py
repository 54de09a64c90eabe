"""comm/_inflight.abandon: a receive nobody will wait for is cancelled, so a later message with its tag goes
to the next receive instead of into the abandoned buffer (MPI); what cannot be cancelled (sends, the torch
backend's receives) is kept alive, with its buffers, until it completes."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from mpitrain.comm._inflight import abandon, orphans
from tests.helpers import assert_all_ranks

pytestmark = pytest.mark.mpi

N = 4096  # 32 KiB of float64: beyond the eager limit, as a pipeline activation


def done_within(req, seconds: float = 20.0) -> bool:
    """Poll `req` for up to `seconds` (a message that went elsewhere fails the test instead of hanging it)."""
    end = time.monotonic() + seconds
    while not req.test():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def test_abandoned_receive_takes_no_later_message(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    stale = torch.full((N,), -1.0, dtype=torch.float64)
    old = comm.irecv(stale, left, tag=77)
    abandon([old])
    comm.barrier()  # every rank abandoned its receive before any message is sent
    got = torch.empty(N, dtype=torch.float64)
    new = comm.irecv(got, left, tag=77)
    sends = [comm.isend(torch.full((N,), float(comm.rank), dtype=torch.float64), right, tag=77)]
    if comm.backend == "mpi":  # cancelled: the first message goes to the new receive
        ok = done_within(new) and torch.equal(stale, torch.full((N,), -1.0, dtype=torch.float64))
    else:  # torch.distributed cannot cancel: the kept receive takes the first message, the new one a second
        sends.append(comm.isend(torch.full((N,), float(comm.rank), dtype=torch.float64), right, tag=77))
        ok = done_within(new) and done_within(old) and torch.equal(stale, got)
    ok = ok and torch.equal(got, torch.full((N,), float(left), dtype=torch.float64))
    for s in sends:
        s.wait()
    assert_all_ranks(comm, ok, f"abandoned receive ({comm.backend} backend)")


def test_abandoned_send_stays_alive_with_its_buffer_until_it_completes(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    send = comm.isend(torch.full((N,), float(comm.rank), dtype=torch.float64), right, tag=78)
    abandon([send])  # not matched yet: kept (with its buffer, whose last reference was the request's)
    kept = any(r is send for r in orphans()) or send.test()
    del send
    gc.collect()
    garbage = [torch.full((N,), 7.0, dtype=torch.float64) for _ in range(64)]  # reuse what was freed
    comm.barrier()
    got = comm.recv(torch.empty(N, dtype=torch.float64), left, tag=78)
    comm.barrier()  # every send has completed: a later abandon drops them from the orphans
    abandon([])
    ok = kept and torch.equal(got, torch.full((N,), float(left), dtype=torch.float64)) and len(garbage) == 64
    assert_all_ranks(comm, ok, "abandoned send")
