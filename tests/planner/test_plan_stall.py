"""fit(strategy="auto")'s planner waits under fit's stall policy: a spatial layout's trial forward in which
one rank fails before its halo exchange ends the job after fit's `abort_after`, not the planner's default
ten minutes. Run from outside the job, as an abort ends every rank."""

from __future__ import annotations

import time

from tests.helpers import run_job


def test_a_trial_forward_stuck_in_a_halo_exchange_ends_after_fits_abort_after():
    t0 = time.monotonic()
    job = run_job("""
        import torch
        from torch import nn
        import mpitrain
        from mpitrain.fit import fit

        comm = mpitrain.init()

        class NoSevenRows(nn.Module):
            '''Refuses an input of 7 rows before its first conv. The images have 15: on the (2, 1) grid one
            rank's block has 7 rows and fails before any halo exchange, while the other runs the conv and
            waits for its halo. (A rank-dependent forward would capture a different graph on each rank.)'''

            def __init__(self):
                super().__init__()
                self.inner = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                           nn.Flatten(), nn.Linear(8, 10))

            def forward(self, x):
                if x.shape[-2] == 7:
                    raise ValueError("seven rows")
                return self.inner(x)

        torch.manual_seed(0)
        x, y = torch.randn(4, 3, 15, 16), torch.randint(0, 10, (4,))
        fit(NoSevenRows(), [(x, y)], nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.1),
            strategy="auto", strategies=["spatial"], cache=False, warn_after=1.0, abort_after=3.0,
            progress=False)
        print("rank", comm.rank, "trained")
    """, timeout=150)
    assert job.returncode != 0 and "trained" not in job.stdout, job.stdout + job.stderr[-3000:]
    assert "gave up after" in job.stderr and "aborting the job" in job.stderr, job.stderr[-3000:]
    assert time.monotonic() - t0 < 120
