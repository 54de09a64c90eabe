"""A rank that stops before a step's weight allreduce (integer targets: fit's one message before the
gradients) makes the waiting ranks say which allreduce they wait in and which ranks are not waiting in it
(the late one among them), then end the job after ``abort_after`` -- not hang (seen from outside, as a user
runs it)."""

from __future__ import annotations

import re
import time

import pytest

from tests.helpers import run_job

JOB = """
import time, torch
from torch import nn
import mpitrain
from mpitrain.fit import fit

comm = mpitrain.init()
LATE = {late}  # this rank stops before its second step


class Batches:
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for step in range(3):
            if step == 1 and comm.rank == LATE:
                time.sleep(60)  # never reaches step 2's weight allreduce within the limits
            yield torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


torch.manual_seed(0)
fit(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), Batches(), nn.CrossEntropyLoss(),
    lambda p: torch.optim.SGD(p, lr=0.1), strategy="{strategy}", progress=False, warn_after=1.0, abort_after=4.0,
    **{options})
print("rank", comm.rank, "finished", flush=True)
"""


@pytest.mark.parametrize(("strategy", "options", "n", "late", "waiter", "named"), [
    ("data", {}, 3, 2, 0, "2"),
    ("pipe-sgd", {}, 2, 1, 0, "1"),
    # replica 1's last stage (rank 3) waits for the weight; ranks 1 and 2 started it but are held up in the
    # pass (the input-shape broadcast rooted at the late rank 0, the partial errors of rank 3)
    ("hybrid", {"partitions": 2, "replicas": 2, "micro_batches": 2, "balance": "params"}, 4, 0, 3, "0, 1, 2"),
])
def test_a_rank_missing_from_the_weight_allreduce_is_named_and_the_job_ends(strategy, options, n, late, waiter,
                                                                           named):
    t0 = time.monotonic()
    job = run_job(JOB.format(strategy=strategy, options=options, late=late), n=n, timeout=120)
    out = job.stdout + job.stderr
    assert job.returncode != 0 and "finished" not in job.stdout, out[-3000:]
    assert re.search(rf"rank {waiter}: still waiting after \ds for the step's weight allreduce \(no\. 2 of the "
                     rf".* trainer, over ranks 0-{n - 1}\); ranks \[{named}\] are not waiting in it", out), out[-3000:]
    assert "aborting the job" in out, out[-3000:]
    assert time.monotonic() - t0 < 50, out[-3000:]  # long before the late rank's 60 s sleep ends
