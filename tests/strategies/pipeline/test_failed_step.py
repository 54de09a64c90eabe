"""A pipeline step that fails midway on one rank leaves no receive for a late message to fill: the user may
catch the exception and go on, and the job still ends cleanly (issue 25 item 4).

Each case is a job (``mpitrain run -n N``, from outside, as a user runs it): one rank raises inside its
partition at micro-batch 2 (forward or backward) while the others, slower, still send it that step's
messages; the failing rank catches the exception, drops the pipeline, allocates the freed memory again and
lets MPI progress. Before the fix, the posted receives of the failed step (their buffers freed) took those
messages: the new tensors were overwritten or the rank died in malloc with "corrupted double-linked list"
(SIGABRT, exit 134). Now: no tensor is overwritten, no rank dies of a signal, and the job ends non-zero
within a bound, the others naming the failing rank when their stall policy ends it."""

from __future__ import annotations

import re
import time

import pytest

from tests.helpers import run_job

JOB = """
import gc, sys, time, torch, mpitrain
from torch import nn
from mpitrain._utils.stall import StallPolicy

FAIL, WHERE, AFTER, SCHEDULE = {fail}, "{where}", "{after}", "{schedule}"
W, B = 512, 64  # a micro-batch's activation (8 rows) is 16 KiB: beyond the shared-memory eager limit
comm = mpitrain.init()
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(2 * comm.size) for m in (nn.Linear(W, W), nn.Tanh())])
pipe = mpitrain.Pipeline(model, partitions=comm.size, micro_batches=8, schedule=SCHEDULE, balance="params",
                         example=torch.randn(B, W), stall=StallPolicy(warn_after=2.0, abort_after=6.0))
x, y = torch.randn(B, W), torch.randn(B, W)
pipe.step(x, y, nn.functional.mse_loss)  # one good step
calls = [0]


def boom(*args):
    calls[0] += 1
    if calls[0] == 3:  # micro-batch 2
        print("FAIL_AT", time.time(), flush=True)
        raise RuntimeError(f"boom in the {{WHERE}} of micro-batch 2 on rank {{comm.rank}}")


part = pipe.stages[0].part.module
if comm.rank == FAIL:
    (part.register_forward_pre_hook if WHERE == "forward" else part.register_full_backward_pre_hook)(boom)
else:  # slower: their messages of the failed step reach the failing rank after it failed
    part.register_forward_pre_hook(lambda *a: time.sleep(0.2))
failed = False
try:
    pipe.step(x, y, nn.functional.mse_loss)
except RuntimeError as e:
    print("caught:", e, flush=True)
    failed = True
if failed:  # the user goes on: the failed step's tensors return to the allocator and are handed out again
    del pipe, part
    gc.collect()
    fresh = [torch.full((B // 8, W), 7.0) for _ in range(2000)]
    t0 = time.time()
    while time.time() - t0 < 1.5:  # MPI progress while the others' messages arrive
        comm.mpi_comm.Iprobe()
        time.sleep(0.01)
    print("overwritten after the failed step:", sum(int((f != 7.0).any()) for f in fresh), flush=True)
    if AFTER == "exit1":
        sys.exit(1)
"""

#: (ranks, failing rank, where it fails, how the user leaves, schedule): a middle partition in forward
#: and in backward, the first partition at 2 ranks; returning normally or sys.exit(1); the zero-bubble
#: schedule (split backward, weight halves owed at the failure) at 3 ranks.
CASES = [(2, 0, "forward", "return", "1f1b"), (3, 1, "forward", "return", "zb1p"),
         (4, 2, "backward", "exit1", "1f1b")]


@pytest.mark.parametrize(("n", "fail", "where", "after", "schedule"), CASES)
def test_a_caught_failure_midway_through_a_step_corrupts_nothing_and_the_job_ends(n, fail, where, after, schedule):
    out = run_job(JOB.format(fail=fail, where=where, after=after, schedule=schedule), n=n, timeout=120)
    end = time.time()
    text = out.stdout + out.stderr
    marks = [float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("FAIL_AT ")]
    assert f"caught: boom in the {where} of micro-batch 2 on rank {fail}" in text, text
    assert "overwritten after the failed step: 0" in text, text
    for sign in ("corrupted", "Signal", "SIGABRT", "signal 6", "Segmentation"):
        assert sign not in text, text
    assert out.returncode not in (0, 134, -6), text
    named = f"(rank {fail})" in text if after == "return" else f"MPI_ABORT was invoked on rank {fail}" in text
    assert named and re.search(r"gave up after|MPI_ABORT", text), text
    assert marks and end - marks[0] < 30, f"job ended {end - marks[0]:.1f}s after the failure"
