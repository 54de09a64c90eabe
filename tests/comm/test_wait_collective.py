"""A collective waited with the stall policy (comm.wait_collective, the step's weight allreduce's wait):
done at once in the usual case; late, each line names the ranks not waiting in it, and the wait still
completes when they come -- also on a later late wait, after notes a rank did not need were left behind
(MPI, 2-4 ranks)."""

from __future__ import annotations

import re
import time

import pytest
import torch

from mpitrain._utils.stall import StallPolicy
from mpitrain.comm import wait_collective
from tests.helpers import assert_all_ranks

pytestmark = pytest.mark.mpi

POLICY = StallPolicy(warn_after=0.8, abort_after=None)  # notes after 0.2 s, the first line at 0.8 s


def _late_round(comm, late: int, seq: int, capfd) -> tuple[bool, str]:
    """An allreduce of the ranks' numbers that rank `late` starts 2 s late; returns (sum right, stderr)."""
    capfd.readouterr()
    if comm.rank == late:
        time.sleep(2.0)
    t = torch.tensor([float(comm.rank + 1)], dtype=torch.float64)
    out = wait_collective(comm.iallreduce(t), comm, seq, f"test allreduce {seq}", POLICY, who=f"rank {comm.rank}")
    want = comm.size * (comm.size + 1) / 2
    return out is not None and float(out[0]) == want, capfd.readouterr().err


def test_a_late_collective_names_the_ranks_not_waiting_in_it_and_completes(comm, capfd):
    if comm.backend != "mpi":  # same verdict on every rank
        pytest.skip("the arrival notes' receives are cancelled only by MPI: torch.distributed's stay pending "
                    "(a later late wait's note is taken by one of them, and gloo aborts at exit on them)")
    t = torch.ones(1, dtype=torch.float64)
    out = wait_collective(comm.iallreduce(t), comm, 0, "quick", POLICY)
    assert_all_ranks(comm, out is not None and float(out[0]) == comm.size, "the quick allreduce")
    last = comm.size - 1
    # round 1: the last rank is late; round 2: rank 0 is late, and the last rank first meets the notes of
    # round 1 that it never needed (its own wait was not late): they must not count for round 2
    for seq, late in ((1, last), (2, 0)):
        ok, err = _late_round(comm, late, seq, capfd)
        line = rf"rank {comm.rank}: still waiting after \d+s for test allreduce {seq}; ranks \[{late}\] are not waiting"
        named = comm.rank == late or re.search(line, err) is not None
        assert_all_ranks(comm, ok and named, f"round {seq}: sum {ok}; stderr {err!r}")
