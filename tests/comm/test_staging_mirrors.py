"""Host mirrors of the staging path: reused per dtype and size, handed back when an operation fails."""

from __future__ import annotations

import pytest
import torch

from mpitrain.comm._staging import Staging


def test_a_returned_mirror_is_lent_again_for_the_same_dtype_and_size():
    s = Staging()
    h = s.take(torch.zeros(3, 4))
    ptr = h.data_ptr()
    s.give(h)
    again = s.take(torch.zeros(12))  # same count, other shape: the same memory, viewed as asked
    assert again.data_ptr() == ptr and again.shape == (12,)
    other = s.take(torch.zeros(12, dtype=torch.float64))
    assert other.data_ptr() != ptr


def test_inplace_copies_in_runs_and_copies_back():
    s = Staging()
    t = torch.arange(6.0)
    seen = []
    s.inplace(t, lambda h: (seen.append(h.clone()), h.mul_(2)))
    assert torch.equal(seen[0], torch.arange(6.0)) and torch.equal(t, torch.arange(6.0) * 2)
    assert t.data_ptr() != seen[0].data_ptr()


def test_a_failing_operation_gives_its_mirror_back():
    s = Staging()

    def fail(h: torch.Tensor) -> None:
        raise RuntimeError("boom")

    t = torch.ones(5)
    with pytest.raises(RuntimeError, match="boom"):
        s.inplace(t, fail)
    assert torch.equal(t, torch.ones(5))  # untouched
    assert len(s._free[(torch.float32, 5)]) == 1


class _Copying:
    """Stands for the CUDA event of a copy back still running (``query()`` False until it is done)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_mirror_whose_copy_back_is_running_is_lent_again_only_once_it_is_done():
    s = Staging()
    h = s.take(torch.zeros(4))
    copy_back = _Copying()
    s.give(h, copy_back)
    busy = s.take(torch.zeros(4))
    assert busy.data_ptr() != h.data_ptr()  # a fresh mirror while the copy runs
    copy_back.done = True
    assert s.take(torch.zeros(4)).data_ptr() == h.data_ptr()


def test_pieces_run_the_operation_per_piece_and_give_the_mirror_back():
    s = Staging()
    t = torch.arange(6.0)
    seen = []
    s.pieces(t, lambda x: list(x.view(-1).split(2)), lambda h: (seen.append(h.clone()), h.mul_(2)))
    assert [p.tolist() for p in seen] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert torch.equal(t, torch.arange(6.0) * 2)
    assert len(s._free[(torch.float32, 6)]) == 1  # lent again, not leaked


def test_a_staged_send_that_cannot_be_posted_ends_the_job_naming_it(capfd):
    """The worker posts a staged send after the caller returned; a send it cannot post would leave the
    receiver waiting forever (the error reaches this rank only when it waits for the send), so the worker
    names the send and calls the communicator's abort at once. Here `post` raises and abort records."""
    from mpitrain.comm._staged_sends import StagedSends

    def post(host: torch.Tensor, dest: int, tag: int):
        raise RuntimeError("MPI refused the send")

    aborts: list[int] = []
    sends = StagedSends(Staging(), post, aborts.append, "rank 3")
    req = sends.isend(torch.ones(2, 5), 1, 7)
    with pytest.raises(RuntimeError, match="MPI refused the send"):
        req.wait()
    sends.close()
    assert aborts == [1]
    assert ("[mpitrain] rank 3: the staged send of (2, 5) torch.float32 on cpu to rank 1 (tag 7) failed "
            "(RuntimeError: MPI refused the send); its receiver would wait forever: aborting the job"
            in capfd.readouterr().err)
