"""send_object / recv_object: pickled point-to-point objects, on both backends (make test reruns
tests/comm with MPITRAIN_BACKEND=torch)."""

from __future__ import annotations

import pytest
import torch

from mpitrain.comm import CommError
from tests.helpers import assert_all_ranks

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("tag", [0, 32124])
def test_objects_pass_along_a_chain_of_ranks_and_back_to_rank_0(comm, tag):
    # rank r receives from r - 1, appends itself, sends to r + 1; the last rank sends to rank 0
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    if comm.rank == 0:
        comm.send_object({"path": [0], "t": torch.arange(3.0)}, nxt, tag)
        got = comm.recv_object(prv, tag)
        ok = got["path"] == list(range(comm.size)) and torch.equal(got["t"], torch.arange(3.0) * comm.size)
    else:
        got = comm.recv_object(prv, tag)
        ok = got["path"] == list(range(comm.rank)) and torch.equal(got["t"], torch.arange(3.0) * comm.rank)
        comm.send_object({"path": [*got["path"], comm.rank], "t": got["t"] + torch.arange(3.0)}, nxt, tag)
    assert_all_ranks(comm, ok, f"rank {comm.rank} received {got!r}")


def test_objects_with_different_tags_are_matched_by_tag(comm):
    if comm.backend != "mpi":
        pytest.skip("gloo's blocking send waits for its receive: tags taken out of order need MPI's eager sends")
    ok = True
    if comm.rank == 0:
        comm.send_object("first", 1, tag=5)
        comm.send_object("second", 1, tag=6)
    elif comm.rank == 1:
        late, early = comm.recv_object(0, tag=6), comm.recv_object(0, tag=5)
        ok = (late, early) == ("second", "first")
    assert_all_ranks(comm, ok, "objects were not matched by tag")


def test_a_bad_peer_raises_before_sending(comm):
    errors = []
    for call in (lambda: comm.send_object(1, comm.size), lambda: comm.recv_object(-1)):
        try:
            call()
        except CommError as e:
            errors.append(str(e))
    assert_all_ranks(comm, len(errors) == 2, f"expected 2 CommErrors, got {errors}")
