"""The stall monitor warns once about a blocking wait that outlives its limit, and never about a quick one."""

from __future__ import annotations

import re
import time
import warnings

from mpitrain._utils.stall import watched


def test_a_long_wait_warns_once_naming_label_and_detail():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watched("ring_allreduce", "waiting for rank 1", warn_after=0.2):
            time.sleep(2.5)  # the monitor wakes once a second: two wake-ups past the limit
        with watched("halo exchange", "quick", warn_after=30.0):
            pass
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert messages == ["ring_allreduce stalled for 0.2 s; waiting for rank 1"], messages


def test_wait_request_warns_naming_who_and_what_then_gives_up_and_later_completes(capfd):
    import pytest
    import torch
    from mpi4py import MPI

    from mpitrain._utils.stall import StallError, StallPolicy
    from mpitrain.comm._mpi import MPICommunicator
    from mpitrain.comm._wait import wait_request

    comm = MPICommunicator(MPI.COMM_SELF)
    req = comm.irecv(torch.zeros(1), 0, tag=99)
    with pytest.raises(StallError, match="rank 0 gave up"):
        wait_request(req, "recv of 'x' from rank 0", StallPolicy(0.2, 0.5), who="rank 0")
    assert "rank 0: still waiting after 0s for recv of 'x' from rank 0" in capfd.readouterr().err
    comm.send(torch.ones(1), 0, tag=99)
    out = wait_request(req, "recv of 'x'")
    assert out is not None and out.item() == 1.0


def test_a_watched_wait_past_abort_after_says_so_and_aborts_once(capfd):
    calls: list[int] = []
    with watched("halo exchange", "rank 0 waits for rank 1", warn_after=0.2, abort_after=1.0, abort=calls.append):
        time.sleep(2.5)  # the monitor wakes once a second: it gives up at its second wake-up at the latest
    assert calls == [1]
    err = capfd.readouterr().err
    assert re.search(r"\[mpitrain\] halo exchange gave up after [12]s; rank 0 waits for rank 1; aborting the job",
                     err), err
